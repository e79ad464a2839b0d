"""``make bench`` (compression part): size, accuracy and latency of the exported variants of the
benchmark convnet, against the targets of the compression work.

One hetflow run trains ``model=convnet`` on ``dataset=synthetic_cifar`` (generated data), then the
evaluate, compress (80 % pruning, int8) and export stages run on it as in the DAG; the numbers come
from export.json, where every artifact was re-loaded from disk and scored on the whole test split.

Writes bench/results/compression-<UTC timestamp>.json and bench/COMPRESSION.md.

    make bench
    .venv/bin/python bench/compression.py --epochs 2 --steps-per-epoch 100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from report import save  # bench/report.py: the scripts run as bench/<name>.py

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

STAGES = """
import sys
from tasks import stages
for stage in (stages.evaluate, stages.compress, stages.export):
    stage(sys.argv[1])
"""


def run(command: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{shlex.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def targets(artifacts: dict) -> list[tuple[str, float, str, bool]]:
    """(what, measured, target, met) for each target of the compression issue."""
    float_tflite, int8 = artifacts["tflite_float"], artifacts["tflite_float_int8"]
    pruned_int8, saved_model = artifacts["tflite_pruned_int8"], artifacts["saved_model"]
    size_ratio = float_tflite["bytes"] / int8["bytes"]
    drop_points = 100 * (float_tflite["test_accuracy"] - int8["test_accuracy"])
    pruned_ratio = saved_model["weights_bytes"] / pruned_int8["gzip_bytes"]
    latency_ratio = int8["latency_ms"] / float_tflite["latency_ms"]
    return [
        ("int8 TFLite smaller than float TFLite (x)", size_ratio, ">= 3.8", size_ratio >= 3.8),
        ("int8 accuracy drop vs float TFLite (points)", drop_points, "<= 0.5", drop_points <= 0.5),
        ("SavedModel weights / (80% pruned + int8 + gzip) (x)", pruned_ratio, ">= 10", pruned_ratio >= 10),
        ("int8 latency / float latency, batch 1", latency_ratio, "<= 0.5", latency_ratio <= 0.5),
    ]


def markdown(record: dict) -> str:
    artifacts, float_accuracy = record["export"]["artifacts"], record["export"]["float_test_accuracy"]
    reference = artifacts["tflite_float"]
    lines = [
        "# Compression benchmark",
        "",
        f"`model=convnet` trained on `dataset=synthetic_cifar` (generated 32×32×3 images), "
        f"{record['epochs']} epochs × {record['steps_per_epoch']} steps; pruning to 80 % sparsity over "
        f"{record['prune_epochs']} fine-tuning epoch(s); int8 calibrated on 200 train images. Every artifact "
        "re-loaded from disk and scored on the whole test split (2,000 images); latency = median of 200 "
        "single-example calls after a warm-up.",
        "",
        f"- date: {record['date']}",
        f"- command: `{record['command']}`",
        f"- machine: {record['machine']}",
        f"- float model test accuracy: {float_accuracy:.4f}; kernel sparsity after pruning: "
        + ", ".join(f"{k} {v:.3f}" for k, v in record["compression"]["kernel_sparsity"].items()),
        "",
        "| artifact | bytes | gzipped | size vs float TFLite | accuracy | Δ vs float (points) | agreement | "
        "latency ms | latency vs float | accepted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, a in artifacts.items():
        lines.append(
            f"| {name} | {a['bytes']:,} | {a['gzip_bytes']:,} | {reference['bytes'] / a['bytes']:.2f}× | "
            f"{a['test_accuracy']:.4f} | {100 * (a['test_accuracy'] - float_accuracy):+.2f} | "
            f"{a['agreement_with_float']:.4f} | {a['latency_ms']:.3f} | "
            f"{a['latency_ms'] / reference['latency_ms']:.2f} | {'yes' if a['accepted'] else 'no'} |"
        )
    lines += [
        "",
        f"SavedModel weights (variables/): {artifacts['saved_model']['weights_bytes']:,} bytes.",
        "",
        "| target | measured | wanted | met |",
        "|---|---:|---|---|",
    ]
    lines += [
        f"| {what} | {value:.2f} | {want} | {'yes' if met else 'NO'} |" for what, value, want, met in record["targets"]
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=150)
    parser.add_argument("--prune-epochs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-") as home:
        env = {**os.environ, "HETFLOW_HOME": home, "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db"}
        settings = {
            "dataset": "synthetic_cifar",
            "model": "convnet",
            "batch_size": 64,
            "epochs": args.epochs,
            "steps_per_epoch": args.steps_per_epoch,
            "prune": "true",
            "target_sparsity": 0.8,
            "prune_epochs": args.prune_epochs,
            "quantize": "int8",
        }
        train = [str(BIN / "hetflow"), "train", *(f"--set={k}={v}" for k, v in settings.items())]
        run_dir = Path(run(train, env).strip().splitlines()[-1]).parent
        run([sys.executable, "-c", STAGES, run_dir.name], env)
        record = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([".venv/bin/python", "bench/compression.py", *sys.argv[1:]]),
            "machine": f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, Python "
            f"{platform.python_version()}",
            "epochs": args.epochs,
            "steps_per_epoch": args.steps_per_epoch,
            "prune_epochs": args.prune_epochs,
            "compression": json.loads((run_dir / "compression.json").read_text()),
            "export": json.loads((run_dir / "export.json").read_text()),
        }
    record["targets"] = targets(record["export"]["artifacts"])
    save("compression", record, "COMPRESSION.md", markdown(record))


if __name__ == "__main__":
    main()

"""``make bench`` (compression part): size, accuracy and latency of every pruning × quantization
variant of the digits models, over seeds.

For each model and seed, ``hetflow train`` (the pipeline's training stage, default spec on
uci_digits) trains the float model; then ``tasks.compress.prune`` (the compress stage's own code:
schedule, fine-tuning, the kernels it leaves dense) prunes it to each sparsity, and
``tasks.tflite.to_tflite`` converts each base with each quantization. Every file is re-loaded
in the LiteRT interpreter and scored on the whole test split by ``tasks.export.score`` (accuracy;
latency = median of 200 batch-1 calls after a warm-up), as export scores what it ships. The
markdown shows mean ± sd over the seeds, every figure computed from the JSON record.

Writes bench/results/compression-<UTC timestamp>.json and bench/COMPRESSION.md.

    make bench
    .venv/bin/python bench/compression.py --models cnn --seeds 1 --sparsities 0.8
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from report import save  # bench/report.py: the scripts run as bench/<name>.py

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
QUANTIZATIONS = ("none", "dynamic", "float16", "int8")


def train(model: str, seed: int, env: dict[str, str]) -> Path:
    """One ``hetflow train`` run; returns its run directory."""
    command = [str(BIN / "hetflow"), "train", f"--set=model={model}", f"--set=seed={seed}"]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{shlex.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1]).parent  # the last line is training.json


def measure(run_dir: Path, sparsities: list[float], work: Path) -> dict:
    """Every (sparsity, quantization) variant of one trained model, converted and scored."""

    from tasks.attempts import load_spec
    from tasks.compress import (
        fine_tuning_epoch_steps,
        kernel_sparsity,
        overall_sparsity,
        prune,
        pruned_layers,
    )
    from tasks.data.pipeline import split_arrays
    from tasks.export import score
    from tasks.models import trained_model
    from tasks.paths import RunPaths
    from tasks.predictors import tflite_predictor
    from tasks.tflite import representative_images, to_tflite

    paths = RunPaths(run_dir)
    spec, dataset = load_spec(paths), json.loads(paths.dataset.read_text())
    model = trained_model(spec, dataset, paths.model)
    images, labels = split_arrays(dataset, "test")
    float_logits = model.predict(images, batch_size=256, verbose=0)
    representative = representative_images(dataset, spec.seed)
    run = {
        "model": spec.model,
        "seed": spec.seed,
        "dataset": f"{dataset['name']}:{dataset['version']}",
        "float_test_accuracy": float((float_logits.argmax(axis=1) == labels).mean()),
        "fine_tuning_steps": spec.prune_epochs * fine_tuning_epoch_steps(spec, dataset),
        "pruned_layers": pruned_layers(model),
        "variants": [],
    }
    for target in (0.0, *sparsities):
        started = time.perf_counter()
        base = prune(model, spec.model_copy(update={"target_sparsity": target}), dataset) if target else model
        pruning = {
            "target_sparsity": target,
            "prune_seconds": time.perf_counter() - started if target else 0.0,
            "sparsity": overall_sparsity(base),
            "kernel_sparsity": kernel_sparsity(base),
        }
        for quantize in QUANTIZATIONS:
            path = work / f"{spec.model}-{spec.seed}-{target}-{quantize}.tflite"
            data = to_tflite(base, quantize, representative)
            path.write_bytes(data)
            run["variants"].append(
                {
                    **pruning,
                    "quantize": quantize,
                    "bytes": len(data),
                    "gzip_bytes": len(gzip.compress(data)),
                    **score(tflite_predictor(path), images, labels, float_logits),
                }
            )
    return run


def summary(runs: list[dict]) -> list[dict]:
    """Mean and sd over seeds of each (model, sparsity, quantization) variant."""
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for run in runs:
        for variant in run["variants"]:
            key = (run["model"], variant["target_sparsity"], variant["quantize"])
            groups.setdefault(key, []).append((run, variant))
    rows = []
    for (model, target, quantize), members in groups.items():
        values = {
            "sparsity": [v["sparsity"] for _, v in members],
            "bytes": [v["bytes"] for _, v in members],
            "gzip_bytes": [v["gzip_bytes"] for _, v in members],
            "test_accuracy": [v["test_accuracy"] for _, v in members],
            "drop_points": [100 * (r["float_test_accuracy"] - v["test_accuracy"]) for r, v in members],
            "latency_ms": [v["latency_ms"] for _, v in members],
        }
        row = {"model": model, "target_sparsity": target, "quantize": quantize, "seeds": len(members)}
        for name, series in values.items():
            row[name] = {"mean": statistics.fmean(series), "sd": statistics.stdev(series) if len(series) > 1 else 0.0}
        rows.append(row)
    return rows


def _pm(stat: dict, digits: int, scale: float = 1.0) -> str:
    return f"{scale * stat['mean']:,.{digits}f} ± {scale * stat['sd']:,.{digits}f}"


def _target(sparsity: float) -> str:
    return f"{sparsity:.0%}" if sparsity else "0 (float)"


def markdown(record: dict) -> str:
    rows, runs = record["summary"], record["runs"]
    reference = [r for r in rows if not r["target_sparsity"] and r["quantize"] == "none"]
    float_gzip = {r["model"]: r["gzip_bytes"]["mean"] for r in reference}
    lines = [
        "# Compression benchmark",
        "",
        f"`hetflow train` on `{record['dataset']}` (default spec) for each model and seed "
        f"({', '.join(map(str, record['seeds']))}). Each float model is pruned by `tasks.compress.prune` to "
        f"each sparsity (kernels under {record['min_pruned_weights']:,} weights stay dense) and converted to "
        "TFLite with each quantization (int8: full integer, calibrated on 200 train images); each file is "
        "re-loaded in the LiteRT interpreter and scored on the whole test split. Latency: median of 200 "
        "batch-1 calls in the interpreter. Every figure is the mean ± sd over the seeds. Δ: the drop in test "
        "accuracy from the float Keras model of the same seed, in points (positive = worse). Sparsity is "
        "measured: the fraction of exact zeros over all kernels.",
        "",
        f"- date: {record['date']}",
        f"- command: `{record['command']}`",
        f"- machine: {record['machine']}",
        f"- wall time: {record['wall_seconds']:.0f} s",
    ]
    for model in record["models"]:
        first = next(r for r in runs if r["model"] == model)
        accuracy = statistics.fmean(r["float_test_accuracy"] for r in runs if r["model"] == model)
        lines.append(
            f"- {model}: float test accuracy {accuracy:.4f}; pruned layers {', '.join(first['pruned_layers'])}; "
            f"{first['fine_tuning_steps']} fine-tuning steps"
        )
    lines += [
        "",
        "## Each sparsity with int8",
        "",
        "| model | target sparsity | measured sparsity | gzipped bytes | vs float TFLite, gzipped | accuracy | Δ |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['model']} | {_target(r['target_sparsity'])} | {_pm(r['sparsity'], 3)} | {_pm(r['gzip_bytes'], 0)} "
        f"| {float_gzip[r['model']] / r['gzip_bytes']['mean']:.1f}× smaller | {_pm(r['test_accuracy'], 4)} "
        f"| {_pm(r['drop_points'], 1)} |"
        for r in rows
        if r["quantize"] == "int8"
    ]
    for model in record["models"]:
        lines += [
            "",
            f"## {model}",
            "",
            "| target sparsity | quantization | measured sparsity | bytes | gzipped | accuracy | Δ | latency µs |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {_target(r['target_sparsity'])} | {r['quantize']} | {_pm(r['sparsity'], 3)} | {_pm(r['bytes'], 0)} "
            f"| {_pm(r['gzip_bytes'], 0)} | {_pm(r['test_accuracy'], 4)} | {_pm(r['drop_points'], 1)} "
            f"| {_pm(r['latency_ms'], 1, 1000)} |"
            for r in rows
            if r["model"] == model
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--sparsities", default="0.5,0.8,0.9")
    args = parser.parse_args()
    models, seeds = args.models.split(","), [int(s) for s in args.seeds.split(",")]
    sparsities = [float(s) for s in args.sparsities.split(",")]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-") as home:
        env = {**os.environ, "HETFLOW_HOME": home, "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db"}
        os.environ.update(env)  # this process reads the runs' data too
        # Before measure() imports TensorFlow: the package sets TF_USE_LEGACY_KERAS.
        import tasks  # noqa: F401
        from tasks.compress import MIN_PRUNED_WEIGHTS

        runs = [measure(train(model, seed, env), sparsities, Path(home)) for model in models for seed in seeds]
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([".venv/bin/python", "bench/compression.py", *sys.argv[1:]]),
        "machine": f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}",
        "dataset": runs[0]["dataset"],
        "models": models,
        "seeds": seeds,
        "sparsities": sparsities,
        "min_pruned_weights": MIN_PRUNED_WEIGHTS,
        "wall_seconds": time.monotonic() - started,
        "runs": runs,
    }
    record["summary"] = summary(runs)
    save("compression", record, "COMPRESSION.md", markdown(record))


if __name__ == "__main__":
    main()

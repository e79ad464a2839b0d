"""``make bench`` (compression part): file size, accuracy and latency of the pruned and quantized
TFLite files of the digits models, over seeds, with and without sparsity-aware encoding.

For each model and seed, ``hetflow train`` (the pipeline's training stage, default spec on
uci_digits: 40 epochs) trains the float model; then ``hetflow.artifacts.compression.prune`` (the compress stage's
own code: schedule, blocks, the kernels it leaves dense, fine-tuning sized from the training run's
training.json) prunes it to each sparsity, and ``hetflow.artifacts.tflite.to_tflite`` converts each base with
each quantization, the pruned ones once with the sparsity encoding (what compress ships) and once
without (the one difference). Every file is re-loaded in the LiteRT interpreter and scored on the
whole test split by ``hetflow.tasks.export.score`` (accuracy; latency = median of 200 batch-1 calls after a
warm-up), as export scores what it ships. The markdown shows mean ± sd over the seeds, every figure
computed from the JSON record.

Writes bench/results/compression-<UTC timestamp>.json and bench/COMPRESSION.md.

    make bench
    .venv/bin/python bench/compression.py --models cnn --seeds 1 --sparsities 0.8
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from pruning_gate import diagnose, gate_markdown, measure_gate
from report import save  # bench/report.py: the scripts run as bench/<name>.py
from run import machine_facts

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
QUANTIZATIONS = ("none", "int8")


def train_command(model: str, seed: int) -> list[str]:
    """The job a seed's float model is trained by: ``hetflow train``, the DAG's training stages
    (validate_spec, prepare_data, provision_cluster, train) with the spec a DAG run of this model and
    seed gets, every other key at its default (tests/test_bench_compression.py compares the two)."""
    return [str(BIN / "hetflow"), "train", f"--set=model={model}", f"--set=seed={seed}"]


def train(model: str, seed: int, env: dict[str, str]) -> Path:
    """One ``hetflow train`` run; returns its run directory."""
    command = train_command(model, seed)
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{shlex.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    # The last line is training.json, in the run's replica_output/.
    return Path(done.stdout.strip().splitlines()[-1]).parents[1]


def measure(run_dir: Path, sparsities: list[float], work: Path) -> dict:
    """Every (sparsity, quantization, encoding) variant of one trained model, converted and scored."""

    from hetflow.artifacts.compression import (
        kernel_sparsity,
        overall_sparsity,
        pruned_layers,
        trained_steps,
    )
    from hetflow.artifacts.predictors import tflite_predictor
    from hetflow.artifacts.scoring import score
    from hetflow.artifacts.tflite import representative_images, to_tflite, weight_encoding
    from hetflow.data.pipeline import split_arrays
    from hetflow.models.architectures import trained_model
    from hetflow.paths import RunPaths
    from hetflow.pipeline.attempts import load_spec
    from hetflow.records import DatasetRecord
    from hetflow.replica.training_json import read_training

    paths = RunPaths(run_dir)
    spec, dataset = load_spec(paths), DatasetRecord.read(paths)
    training = read_training(paths.training, spec, dataset)
    model = trained_model(spec, dataset, paths.model)
    images, labels = split_arrays(dataset, "test")
    float_logits = model.predict(images, batch_size=256, verbose=0)
    representative = representative_images(dataset, spec.training.seed)
    run = {
        "model": spec.model.architecture,
        "seed": spec.training.seed,
        "dataset": f"{dataset.name}:{dataset.version}",
        "float_test_accuracy": float((float_logits.argmax(axis=1) == labels).mean()),
        "trained_steps": trained_steps(training),
        "train_seconds": training.train_seconds,
        "pruned_layers": pruned_layers(model),
        "variants": [],
    }
    # The files below are made from the models pruned by compress's rule for the gate.
    run["gate"], pruned_by_compress = measure_gate(model, spec, dataset, training, sparsities, float_logits, work)
    for target in (0.0, *sparsities):
        base = pruned_by_compress[target] if target else model
        gate = next((e for e in run["gate"] if e["target_sparsity"] == target and e["rule"] == "recovery"), None)
        pruning = {
            "target_sparsity": target,
            "fine_tuning_seconds": gate["fine_tuning_seconds"] if gate else 0.0,
            "fine_tuning_steps": gate["fine_tuning"]["steps"] if gate else 0,
            "sparsity": overall_sparsity(base),
            "kernel_sparsity": kernel_sparsity(base),
        }
        for quantize in QUANTIZATIONS:
            for sparse in (True, False) if target else (False,):
                path = work / f"{spec.model.architecture}-{spec.training.seed}-{target}-{quantize}-{sparse}.tflite"
                data = to_tflite(base, quantize, representative, sparse=sparse)
                path.write_bytes(data)
                run["variants"].append(
                    {
                        **pruning,
                        "quantize": quantize,
                        "sparse_encoding_asked": sparse,
                        **weight_encoding(data),
                        "bytes": len(data),
                        "gzip_bytes": len(gzip.compress(data)),
                        **score(tflite_predictor(path), images, labels, float_logits),
                    }
                )
    return run


def summary(runs: list[dict]) -> list[dict]:
    """Mean and sd over seeds of each (model, sparsity, quantization, encoding) variant; bytes
    relative to the same seed's dense file of the same quantization and to its dense float file."""
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for run in runs:
        for variant in run["variants"]:
            key = (run["model"], variant["target_sparsity"], variant["quantize"], variant["sparse_encoding_asked"])
            groups.setdefault(key, []).append((run, variant))

    def dense(run: dict, quantize: str) -> dict:
        return next(v for v in run["variants"] if not v["target_sparsity"] and v["quantize"] == quantize)

    rows = []
    for (model, target, quantize, sparse), members in groups.items():
        values = {
            "sparsity": [v["sparsity"] for _, v in members],
            "bytes": [v["bytes"] for _, v in members],
            "smaller_than_dense_same_quantization": [dense(r, quantize)["bytes"] / v["bytes"] for r, v in members],
            "smaller_than_dense_float": [dense(r, "none")["bytes"] / v["bytes"] for r, v in members],
            "gzip_bytes": [v["gzip_bytes"] for _, v in members],
            "test_accuracy": [v["test_accuracy"] for _, v in members],
            "drop_points": [100 * (r["float_test_accuracy"] - v["test_accuracy"]) for r, v in members],
            "latency_ms": [v["latency_ms"] for _, v in members],
            "fine_tuning_seconds": [v["fine_tuning_seconds"] for _, v in members],
        }
        row = {
            "model": model,
            "target_sparsity": target,
            "quantize": quantize,
            "sparse_encoding_asked": sparse,
            "encodings": sorted({v["encoding"] for _, v in members}),
            "seeds": len(members),
        }
        for name, series in values.items():
            row[name] = {"mean": statistics.fmean(series), "sd": statistics.stdev(series) if len(series) > 1 else 0.0}
        rows.append(row)
    return rows


def _code_lines(record: dict) -> list[str]:
    """The code the runs trained with: the checkout at the start and at the end (results files from
    before these were recorded have neither); every `hetflow train` runs the tree as it is then."""
    if "git_at_start" not in record:
        return []
    start, end = record["git_at_start"], record["git_at_end"]
    line = f"- code: git {start}" + (f" at the start, {end} at the end" if end != start else "")
    if start.endswith("-dirty") or end.endswith("-dirty"):
        line += " (-dirty: uncommitted changes, which the runs trained with and no commit holds)"
    return [line]


def _pm(stat: dict, digits: int, scale: float = 1.0) -> str:
    return f"{scale * stat['mean']:,.{digits}f} ± {scale * stat['sd']:,.{digits}f}"


def _target(sparsity: float) -> str:
    return f"{sparsity:.0%}" if sparsity else "0 (dense)"


def markdown(record: dict) -> str:
    rows = record["summary"]
    lines = [*_method_lines(record), *_code_lines(record), *_findings_lines(record), "", *gate_markdown(record)]
    lines += [*_shipped_table(rows), *_every_file_table(rows)]
    return "\n".join(lines) + "\n"


def _method_lines(record: dict) -> list[str]:
    """The title, how every file was made and measured, what ran and when."""
    return [
        "# Compression benchmark",
        "",
        f"`hetflow train` (the DAG's training stages, with the spec a DAG run of the model and seed validates) on "
        f"`{record['dataset']}` (default spec: 40 epochs) for each model and seed "
        f"({', '.join(map(str, record['seeds']))}). Each float model is pruned by "
        f"`hetflow.artifacts.compression.prune` to each sparsity (hidden kernels of at least "
        f"{record['min_pruned_weights']:,} weights; Dense kernels in "
        f"{record['dense_block'][0]}x{record['dense_block'][1]} blocks; the logits dense), fine-tuned until "
        f"validation accuracy recovers (compress's rule: at most {record['fine_tuning_share']} of the steps the "
        "model trained; the gate section below compares it with a fixed length), and converted to TFLite as "
        "float and as int8 (full integer, calibrated on 200 train images), the pruned models once with the sparsity "
        "encoding (`tf.lite.Optimize.EXPERIMENTAL_SPARSITY`, what compress ships) and once without. Each file "
        "is re-loaded in the LiteRT interpreter and scored on the whole test split. Latency: median of 200 "
        "batch-1 calls in the interpreter. Every figure is the mean ± sd over the seeds. Δ: the drop in test "
        "accuracy from the float Keras model of the same seed, in points (positive = worse). Sparsity is "
        "measured: the fraction of exact zeros over all Dense and Conv2D kernels. Bytes: the file itself, no "
        "gzip. Encoding: read back from each file (sparse: some tensor carries TFLite sparsity metadata).",
        "",
        f"What ran (kept small: 2 cores shared with other work): models {', '.join(record['models'])}, seeds "
        f"{', '.join(map(str, record['seeds']))}, sparsities {', '.join(f'{x:.0%}' for x in record['sparsities'])}, "
        f"quantizations {', '.join(record['quantizations'])} (dynamic and float16 files are not sparse-encoded, "
        "see hetflow/artifacts/tflite.py).",
        "",
        f"- date: {record['date']}",
        f"- command: `{record['command']}`",
        f"- machine: {record['machine']}",
        f"- wall time: {record['wall_seconds']:.0f} s",
    ]


def _findings_lines(record: dict) -> list[str]:
    """What the tables leave out, the worst int8 drop, each model's training and what the sparse
    encoding does to each pruned file."""
    runs, rows = record["runs"], record["summary"]
    worst_int8_drop = max(
        100 * (run["float_test_accuracy"] - variant["test_accuracy"])
        for run in runs
        for variant in run["variants"]
        if variant["target_sparsity"] and variant["quantize"] == "int8"
    )
    lines = [
        "",
        "The file tables measure post-training int8 only (the gate section makes the int8 file as compress "
        "does): compress fine-tunes quantization-aware instead only "
        "where post-training int8 loses more than max_accuracy_drop on the validation split "
        "(tests/test_tasks_compress_qat.py shows a case). The largest drop of a single seed's pruned int8 "
        "file here, on the test split: "
        f"{worst_int8_drop:.2f} points. "
        "Latency is measured on the same 2 shared cores as everything else, hence the wide spreads. A sparse "
        "float file carries a DENSIFY op before each sparse layer (the interpreter expands the tensor), so the "
        "encoding is for bytes; each pair's latency ratio is below.",
        "",
    ]
    for model in record["models"]:
        mine = [r for r in runs if r["model"] == model]
        accuracy = statistics.fmean(r["float_test_accuracy"] for r in mine)
        lines.append(
            f"- {model}: float test accuracy {accuracy:.4f}; pruned layers {', '.join(mine[0]['pruned_layers'])}; "
            f"trained {statistics.fmean(r['trained_steps'] for r in mine):.0f} steps in "
            f"{statistics.fmean(r['train_seconds'] for r in mine):.1f} s"
        )
    by_key = {(r["model"], r["target_sparsity"], r["quantize"], r["sparse_encoding_asked"]): r for r in rows}
    for model in record["models"]:
        for target in record["sparsities"]:
            for quantize in record["quantizations"]:
                encoded, plain = by_key[(model, target, quantize, True)], by_key[(model, target, quantize, False)]
                lines.append(
                    f"- {model} {target:.0%} {quantize}: the sparse encoding makes the file "
                    f"{plain['bytes']['mean'] / encoded['bytes']['mean']:.2f}x smaller than the same pruned model "
                    f"without it; latency {encoded['latency_ms']['mean'] / plain['latency_ms']['mean']:.2f}x"
                )
    return lines


def _shipped_table(rows: list[dict]) -> list[str]:
    """The files compress would ship: the dense ones and the pruned ones with the sparse encoding."""
    return [
        "## The shipped pruned files (sparse encoding) against the dense ones",
        "",
        "| model | target sparsity | quantization | measured sparsity | bytes "
        "| × smaller than dense, same quantization | × smaller than dense float | accuracy | Δ | latency µs "
        "| fine-tuning s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['model']} | {_target(r['target_sparsity'])} | {r['quantize']} | {_pm(r['sparsity'], 3)} "
            f"| {_pm(r['bytes'], 0)} | {_pm(r['smaller_than_dense_same_quantization'], 2)} "
            f"| {_pm(r['smaller_than_dense_float'], 2)} | {_pm(r['test_accuracy'], 4)} | {_pm(r['drop_points'], 2)} "
            f"| {_pm(r['latency_ms'], 1, 1000)} | {_pm(r['fine_tuning_seconds'], 1)} |"
            for r in rows
            if r["sparse_encoding_asked"] or not r["target_sparsity"]
        ),
    ]


def _every_file_table(rows: list[dict]) -> list[str]:
    return [
        "",
        "## Every file",
        "",
        "| model | target sparsity | quantization | encoding asked | encoding in the file | bytes | gzipped | accuracy "
        "| Δ | latency µs |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|",
        *(
            f"| {r['model']} | {_target(r['target_sparsity'])} | {r['quantize']} "
            f"| {'sparse' if r['sparse_encoding_asked'] else 'none'} | {', '.join(r['encodings'])} "
            f"| {_pm(r['bytes'], 0)} | {_pm(r['gzip_bytes'], 0)} | {_pm(r['test_accuracy'], 4)} "
            f"| {_pm(r['drop_points'], 2)} | {_pm(r['latency_ms'], 1, 1000)} |"
            for r in rows
        ),
    ]


def diagnose_failures(record: dict) -> None:
    """Retrain each seed compress's rule fails at a sparsity and measure what bounds it
    (``pruning_gate.diagnose``); save the record with them as a new results file."""
    failing = [
        (run["model"], run["seed"], entry["target_sparsity"])
        for run in record["runs"]
        for entry in run["gate"]
        if entry["rule"] == "recovery" and not entry["accepted"]
    ]
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-") as home:
        env = {**os.environ, "HETFLOW_HOME": home, "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db"}
        os.environ.update(env)
        import hetflow  # noqa: F401  (before TensorFlow: the package sets TF_USE_LEGACY_KERAS)
        from hetflow.models.architectures import trained_model
        from hetflow.paths import RunPaths
        from hetflow.pipeline.attempts import load_spec
        from hetflow.records import DatasetRecord
        from hetflow.replica.training_json import read_training

        record["bounds"] = []
        for model, seed, target in failing:
            paths = RunPaths(train(model, seed, env))
            spec, dataset = load_spec(paths), DatasetRecord.read(paths)
            trained = trained_model(spec, dataset, paths.model)
            bound = diagnose(trained, spec, dataset, read_training(paths.training, spec, dataset), target)
            record["bounds"].append({"model": model, "seed": seed, **bound})
    save("compression", record, "COMPRESSION.md", markdown)


def cpu_vector_extensions() -> str:
    """Whether the CPU has AVX-512, which decides the oneDNN kernels TensorFlow's CPU ops run: the
    rounding, and so the trained weights, may differ between machines that differ in it."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return "AVX-512" if " avx512f" in flags else "no AVX-512"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--seeds", default="42,1,2,3,4,5,6,7,8,9")
    parser.add_argument("--sparsities", default="0.5,0.8")
    parser.add_argument("--render", metavar="JSON", help="only rewrite COMPRESSION.md from this results file")
    parser.add_argument(
        "--diagnose", metavar="JSON", help="add to this results file what bounds each seed the gate rejects"
    )
    args = parser.parse_args()
    if args.render:
        (Path(__file__).with_name("COMPRESSION.md")).write_text(markdown(json.loads(Path(args.render).read_text())))
        return
    if args.diagnose:
        diagnose_failures(json.loads(Path(args.diagnose).read_text()))
        return
    models, seeds = args.models.split(","), [int(s) for s in args.seeds.split(",")]
    sparsities = [float(s) for s in args.sparsities.split(",")]
    started, machine = time.monotonic(), machine_facts()
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-") as home:
        env = {**os.environ, "HETFLOW_HOME": home, "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db"}
        os.environ.update(env)  # this process reads the runs' data too
        # Before measure() imports TensorFlow: the package sets TF_USE_LEGACY_KERAS.
        import hetflow  # noqa: F401
        from hetflow.artifacts.compression import DENSE_BLOCK, MIN_PRUNED_WEIGHTS
        from hetflow.spec import RunSpec

        runs = [measure(train(model, seed, env), sparsities, Path(home)) for model in models for seed in seeds]
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([".venv/bin/python", "bench/compression.py", *sys.argv[1:]]),
        "machine": f"{machine['nproc']} CPUs, {machine['cpu_model']} ({cpu_vector_extensions()}), TensorFlow "
        f"{machine['tensorflow']}, Python {machine['python']}",
        "git_at_start": machine["git"],
        "git_at_end": machine_facts()["git"],
        "dataset": runs[0]["dataset"],
        "models": models,
        "seeds": seeds,
        "sparsities": sparsities,
        "quantizations": list(QUANTIZATIONS),
        "min_pruned_weights": MIN_PRUNED_WEIGHTS,
        "dense_block": list(DENSE_BLOCK),
        "fine_tuning_share": RunSpec().compression.fine_tuning_share,
        "max_accuracy_drop": RunSpec().export.max_accuracy_drop,
        "wall_seconds": time.monotonic() - started,
        "runs": runs,
    }
    record["summary"] = summary(runs)
    save("compression", record, "COMPRESSION.md", markdown)


if __name__ == "__main__":
    main()

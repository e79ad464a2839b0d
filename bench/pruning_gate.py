"""The compression bench's gate over seeds (bench/compression.py calls it for each trained model).

For each sparsity, the trained float model is pruned twice by the compress stage's own ``prune``,
the two differing in one thing, when the fine-tuning stops:
- ``recovery``: compress's rule (``pruning_recovery``): once validation accuracy is back within half the
  gate's budget of the float model's, or stops improving, at most ``fine_tuning_share`` of the steps
  trained;
- ``fixed``: the fixed length it replaced: 0.75 of the steps trained, whatever the validation curve does.
Both ramp sparsity over the same steps and keep the best checked round's weights. Each pruned model
then gets its int8 file as compress makes it (``int8_file``: post-training, or quantization-aware where
that loses), which export's own ``judge`` accepts or rejects against the float model's test accuracy.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from pathlib import Path

# The fine-tuning length before the recovery rule: this share of the steps trained.
FIXED_SHARE = 0.75
RULES = ("recovery", "fixed")


def measure_gate(model, spec, dataset, training, sparsities, float_logits, work: Path) -> tuple[list[dict], dict]:
    """One entry per (sparsity, rule): the fine-tuning's record and seconds, and the gate's verdict;
    and the models compress's rule pruned, by sparsity."""
    from hetflow.artifacts.compression import (
        MIN_FINE_TUNING_STEPS,
        int8_file,
        keras_accuracy,
        prune,
        pruning_recovery,
        trained_steps,
        validation_arrays,
    )
    from hetflow.artifacts.predictors import tflite_predictor
    from hetflow.artifacts.scoring import judge, score
    from hetflow.data.pipeline import split_arrays
    from hetflow.models.fine_tuning import Recovery
    from hetflow.spec import RunSpec

    images, labels = split_arrays(dataset, "test")
    float_test_accuracy = float((float_logits.argmax(axis=1) == labels).mean())
    float_validation_accuracy = keras_accuracy(model, *validation_arrays(dataset))
    entries, pruned_by_compress = [], {}
    for target in sparsities:
        sparse_spec = RunSpec.from_values({**spec.flat(), "target_sparsity": target})
        recovery = pruning_recovery(sparse_spec, training, float_validation_accuracy)
        fixed_steps = max(MIN_FINE_TUNING_STEPS, round(FIXED_SHARE * trained_steps(training)))
        fixed = Recovery(
            target_accuracy=float("inf"),  # never "recovered": runs its whole length
            max_steps=fixed_steps,
            check_every=recovery.check_every,
            first_check=recovery.first_check,
            patience=fixed_steps,
        )
        for rule, stopping in zip(RULES, (recovery, fixed)):
            started = time.perf_counter()
            pruned, fine_tuning = prune(model, sparse_spec, dataset, stopping)
            fine_tuning_seconds = time.perf_counter() - started
            if rule == "recovery":
                pruned_by_compress[target] = pruned
            path = work / f"gate-{spec.model.architecture}-{spec.training.seed}-{target}-{rule}.tflite"
            data, choice = int8_file(
                pruned, sparse_spec, dataset, stopping.max_steps // 2, sparse=True, scratch=path.with_suffix(".probe")
            )
            path.write_bytes(data)
            artifact = {
                "format": "tflite",
                "bytes": len(data),
                **score(tflite_predictor(path), images, labels, float_logits),
            }
            judge({"pruned_int8": artifact}, float_test_accuracy, spec.export.max_accuracy_drop)
            entries.append(
                {
                    "target_sparsity": target,
                    "rule": rule,
                    "fine_tuning": fine_tuning,
                    "fine_tuning_seconds": fine_tuning_seconds,
                    "int8_method": choice["int8_method"],
                    "pruned_keras_test_accuracy": keras_accuracy(pruned, images, labels),
                    "test_accuracy": artifact["test_accuracy"],
                    "drop_points": 100 * artifact["accuracy_drop"],
                    "accepted": artifact["accepted"],
                }
            )
    return entries, pruned_by_compress


# A failing seed's fine-tuning is rerun this many times the steps trained, scored at every check on
# the validation split (what the rule sees) and the test split (what the gate judges).
DIAGNOSIS_SHARE = 3


def diagnose(model, spec, dataset, training, target: float) -> dict:
    """Whether a longer fine-tuning, or a better-chosen checkpoint, would have passed the gate: the
    pruned Keras model's test accuracy at every check of a DIAGNOSIS_SHARE-long fine-tuning."""
    import tensorflow as tf

    from hetflow.artifacts import compression
    from hetflow.data.pipeline import split_arrays
    from hetflow.models.fine_tuning import Recovery
    from hetflow.spec import RunSpec

    sparse_spec = RunSpec.from_values({**spec.flat(), "target_sparsity": target})
    validation, test = compression.validation_arrays(dataset), split_arrays(dataset, "test")
    float_test_accuracy = compression.keras_accuracy(model, *test)
    rule = compression.pruning_recovery(sparse_spec, training, compression.keras_accuracy(model, *validation))
    checks = []

    class BothSplits(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            step = (epoch + 1) * rule.check_every
            if step >= rule.first_check:
                scores = (compression.keras_accuracy(self.model, *split) for split in (validation, test))
                checks.append([step, *scores])

    length = DIAGNOSIS_SHARE * compression.trained_steps(training)
    never_stops = Recovery(float("inf"), length, rule.check_every, rule.first_check, patience=length)
    compression.prune(model, sparse_spec, dataset, never_stops, callbacks=[BothSplits()])
    best_validation = max(checks, key=lambda check: check[1])
    return {
        "target_sparsity": target,
        "validation_images": len(validation[1]),
        "test_images": len(test[1]),
        "checks": checks,
        "best_test_drop_points": 100 * (float_test_accuracy - max(check[2] for check in checks)),
        "test_drop_at_best_validation_points": 100 * (float_test_accuracy - best_validation[2]),
        "checks_within_budget": sum(float_test_accuracy - test <= spec.export.max_accuracy_drop for *_, test in checks),
    }


def gate_markdown(record: dict) -> list[str]:
    """COMPRESSION.md's section on the gate over seeds, every figure from ``record``."""
    budget = 100 * record["max_accuracy_drop"]
    lines = [
        "## The gate over seeds: fine-tuning stopped on recovery against a fixed length",
        "",
        f"Export's gate rejects a file more than {budget:g} point below the float model's test accuracy. "
        "`recovery`: compress's rule (the fine-tuning stops once validation accuracy is back within half the "
        f"budget of the float model's, or has not improved for 4 checks; at most {record['fine_tuning_share']} of "
        f"the steps trained); `fixed`: the {FIXED_SHARE} of the steps trained it replaced. Both ramp sparsity over "
        "the same steps; the int8 file is made as compress makes it (post-training, quantization-aware where "
        "that loses on validation). Steps and seconds: the pruning fine-tuning, ramp included.",
        "",
        "| model | target sparsity | rule | pass the gate | steps median | steps max | stopped | seconds mean "
        "| Δ median | Δ worst | worst seed |",
        "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for model in record["models"]:
        runs = [r for r in record["runs"] if r["model"] == model]
        for target in record["sparsities"]:
            for rule in RULES:
                entries = [
                    (run["seed"], e)
                    for run in runs
                    for e in run["gate"]
                    if e["target_sparsity"] == target and e["rule"] == rule
                ]
                steps = [e["fine_tuning"]["steps"] for _, e in entries]
                stopped = Counter(e["fine_tuning"]["stopped"].replace("_", " ") for _, e in entries)
                worst_seed, worst = max(entries, key=lambda seeded: seeded[1]["drop_points"])
                lines.append(
                    f"| {model} | {target:.0%} | {rule} | {sum(e['accepted'] for _, e in entries)} of {len(entries)} "
                    f"| {statistics.median(steps):.0f} | {max(steps)} "
                    f"| {', '.join(f'{n} {reason}' for reason, n in sorted(stopped.items()))} "
                    f"| {statistics.fmean(e['fine_tuning_seconds'] for _, e in entries):.1f} "
                    f"| {statistics.median(e['drop_points'] for _, e in entries):+.2f} "
                    f"| {worst['drop_points']:+.2f} | {worst_seed} |"
                )
    failing = [
        (run["model"], run["seed"], e)
        for run in record["runs"]
        for e in run["gate"]
        if e["rule"] == "recovery" and not e["accepted"]
    ]
    float_accuracy = {(run["model"], run["seed"]): run["float_test_accuracy"] for run in record["runs"]}
    lines += [
        "",
        "Files the gate rejects under compress's rule:" if failing else "Under compress's rule every file passes.",
    ]
    lines += [
        f"- {model} seed {seed} at {e['target_sparsity']:.0%}: {e['drop_points']:+.2f} points (budget {budget:g}); "
        f"the pruned Keras model alone {100 * (float_accuracy[model, seed] - e['pruned_keras_test_accuracy']):+.2f}; "
        f"fine-tuning {e['fine_tuning']['stopped'].replace('_', ' ')} after {e['fine_tuning']['steps']} steps; "
        f"int8 {e['int8_method'].replace('_', '-')}"
        for model, seed, e in failing
    ]
    stopped_at = {
        (run["model"], run["seed"], e["target_sparsity"]): e["fine_tuning"]["steps"]
        for run in record["runs"]
        for e in run["gate"]
        if e["rule"] == "recovery"
    }
    for bound in record.get("bounds", []):
        best_step = max(bound["checks"], key=lambda check: check[1])[0]
        lines.append(
            f"- what bounds {bound['model']} seed {bound['seed']} at {bound['target_sparsity']:.0%}: fine-tuned "
            f"{DIAGNOSIS_SHARE}x the steps trained, scored at each of its {len(bound['checks'])} checks, the pruned "
            f"Keras model is at best {bound['best_test_drop_points']:+.2f} points on the test split and "
            f"{bound['test_drop_at_best_validation_points']:+.2f} at the check the validation split ranks best "
            f"(step {best_step}; compress's rule stopped at step "
            f"{stopped_at[bound['model'], bound['seed'], bound['target_sparsity']]}); "
            f"{bound['checks_within_budget']} of the checks are within the budget on the test split, but the "
            f"validation split ({bound['validation_images']} images, one of them "
            f"{100 / bound['validation_images']:.2f} points) does not rank them first"
        )
    return lines + [""]

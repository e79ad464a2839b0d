"""``make bench`` (tuning): the tuner with pruning against the grid over the same space, run in full.

The job: ``mlp`` on the embedded digits, two local workers, worker 1 throttled to half the CPU time
(``slowdown`` 2), at most 30 epochs, racing to validation accuracy 0.95. The space: sync with equal
batches, sync with balanced batches (``balance_batches``), async (``parameter_server``, one ps), each
at learning rates 0.001, 0.003 and 0.01: nine configurations.

- ``grid``: the nine as a study without pruning (each queued once), every trial to its end.
- ``tuner``: ``hetflow_tune``'s study (TPE sampler, the wall-clock median pruner) with a budget of
  nine trials over the same choices and the learning rate drawn from [0.001, 0.01].

Both run through ``run_study``, as the DAG runs it. Reported: the grid's best launch-to-target and its
whole wall time; the tuner's best, and the wall time (from its study's start) at which its best so far
first came within 10 % of the grid's best. Aim: within 10 % in at most half the grid's wall time.

Writes bench/results/tune-<UTC timestamp>.json and bench/TUNE.md; ``--summary-of RECORD`` rewrites the
summary from a saved record, running nothing.

    .venv/bin/python bench/tune.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from report import save  # bench/report.py: the scripts run as bench/<name>.py
from run import machine_facts

BASE = {
    "model": "mlp",
    "epochs": 30,
    "workers": 2,
    "worker_devices": [{"threads": 1}, {"threads": 1, "slowdown": 2}],
}
TARGET = 0.95
LEARNING_RATES = [0.001, 0.003, 0.01]
STRATEGIES = ["multi_worker_mirrored", "parameter_server"]
GRID = [
    *(
        {"strategy": "multi_worker_mirrored", "balance_batches": balanced, "learning_rate": lr}
        for balanced in (False, True)
        for lr in LEARNING_RATES
    ),
    *({"strategy": "parameter_server", "learning_rate": lr} for lr in LEARNING_RATES),
]
WITHIN = 0.10


def study(name: str, pruning: bool) -> dict:
    """Run one study through the stages; its trials as trials.json records them, with when each
    ended (seconds from the study's start)."""
    from hetflow.paths import read_replica_record, run_paths
    from hetflow.tasks.run_study import run_study
    from hetflow.tasks.validate_study import validate_study
    from hetflow.tuning import study as tuning
    from hetflow.tuning.space import StudySpec

    values = {
        "base": BASE,
        "choices": {"strategy": STRATEGIES, "balance_batches": [False, True]},
        "ranges": {"learning_rate": [LEARNING_RATES[0], LEARNING_RATES[-1]]},
        "target_accuracy": TARGET,
        "trials": len(GRID),
        "budget_seconds": 4 * 3600,
        "pruning": pruning,
    }
    validate_study(values, name)
    spec = StudySpec.model_validate_json(run_paths(name).study.read_text())
    if not pruning:
        queued = tuning.load(name, spec)
        for params in GRID:
            queued.enqueue_trial(params)
    started = time.time()
    run_study(name)
    trials = read_replica_record(run_paths(name).trials, list)
    finished = {t.number: t.datetime_complete.timestamp() - started for t in tuning.load(name, spec).trials}
    for trial in trials:
        trial["ended_after_seconds"] = finished[trial["number"]]
        trial.pop("curve", None)
    return {"wall_seconds": time.time() - started, "trials": trials}


def best(trials: list[dict]) -> float | None:
    reached = [t["launch_to_target_seconds"] for t in trials if t["launch_to_target_seconds"] is not None]
    return min(reached) if reached else None


def found_within(trials: list[dict], bar: float) -> float | None:
    """Seconds from the study's start until its best so far was within ``bar``."""
    for trial in sorted(trials, key=lambda t: t["ended_after_seconds"]):
        if trial["launch_to_target_seconds"] is not None and trial["launch_to_target_seconds"] <= bar:
            return trial["ended_after_seconds"]
    return None


def summary(record: dict) -> str:
    grid, tuner = record["grid"], record["tuner"]
    grid_best, tuner_best = best(grid["trials"]), best(tuner["trials"])
    bar = grid_best * (1 + WITHIN) if grid_best is not None else None
    found = found_within(tuner["trials"], bar) if bar is not None else None
    met = found is not None and found <= grid["wall_seconds"] / 2
    lines = [
        "# Tuning: the tuner with pruning against the full grid",
        "",
        f"Written by `bench/tune.py` from `{record['results_file']}`; one run of each study.",
        "",
        f"Job: {', '.join(f'{k}={v}' for k, v in BASE.items())}; target validation accuracy {TARGET}; "
        f"{record['machine']['cpu_model']}, {record['machine']['nproc']} CPUs. Space: sync (equal or balanced "
        "batches) and async, learning rate 0.001 to 0.01.",
        "",
        "| study | trials | wall s | best launch to target s |",
        "|---|---:|---:|---:|",
        f"| grid (9, no pruning) | {len(grid['trials'])} | {grid['wall_seconds']:.0f} | {grid_best:.1f} |",
        f"| tuner (TPE + pruning) | {len(tuner['trials'])} | {tuner['wall_seconds']:.0f} | {tuner_best:.1f} |",
        "",
        "| study | trial | settings | state | launch to target s | best val accuracy | ended after s |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for name, result in (("grid", grid), ("tuner", tuner)):
        for t in result["trials"]:
            settings = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t["params"].items())
            target = "" if t["launch_to_target_seconds"] is None else f"{t['launch_to_target_seconds']:.1f}"
            lines.append(
                f"| {name} | {t['number']} | {settings} | {t['state']} | {target} | {t['best_accuracy']:.4f} "
                f"| {t['ended_after_seconds']:.0f} |"
            )
    verdict = (
        f"the tuner's best so far came within {100 * WITHIN:.0f} % of the grid's best after {found:.0f} s, "
        f"{found / grid['wall_seconds']:.2f} of the grid's wall time"
        if found is not None
        else f"the tuner never came within {100 * WITHIN:.0f} % of the grid's best"
    )
    lines += [
        "",
        f"Aim (within 10 % in at most half the grid's wall time): {'met' if met else 'not met'}: {verdict}.",
    ]
    grid_times = [t["launch_to_target_seconds"] for t in grid["trials"] if t["launch_to_target_seconds"] is not None]
    pruned = [t for t in tuner["trials"] if t["state"] == "pruned"]
    complete = [t for t in tuner["trials"] if t["state"] == "complete"]

    def mean_wall(trials: list[dict]) -> float:
        return sum(t["wall_seconds"] for t in trials) / len(trials)

    pruning = (
        f"the {len(pruned)} pruned trials still ran {mean_wall(pruned):.0f} s each against {mean_wall(complete):.0f} s "
        f"for a complete one, and the tuner's whole study took {tuner['wall_seconds'] / grid['wall_seconds']:.2f} "
        "of the grid's wall time."
        if pruned and complete
        else "none was pruned."
    )
    lines += [
        "",
        f"What bounds it: on this job the grid's slowest configuration took {max(grid_times) / min(grid_times):.2f}x "
        "its fastest to the target, so almost any draw lands near the best, and the figure says little of the "
        f"search. Pruning stops a trial only once it has reported epochs, and here trials end soon after: {pruning}",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--summary-of":
        record = json.loads(Path(sys.argv[2]).read_text())
        (Path(__file__).parent / "TUNE.md").write_text(summary(record))
        return 0
    home = Path(tempfile.mkdtemp(prefix="hetflow-bench-tune-"))
    (home / "mlflow").mkdir()
    os.environ.update(HETFLOW_HOME=str(home), MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow' / 'mlflow.db'}")
    stamp = f"{os.getpid()}"
    grid = study(f"bench-grid-{stamp}", pruning=False)
    tuner = study(f"bench-tuner-{stamp}", pruning=True)
    record = {
        "base": BASE,
        "target_accuracy": TARGET,
        "machine": machine_facts(),
        "grid": grid,
        "tuner": tuner,
    }
    save("tune", record, "TUNE.md", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A study in MLflow: a parent run, each trial's run nested under it (its state and launch-to-target
on it), and on the parent the comparison a person reads at a glance: a table of the trials, time to
target per trial, and the validation curves of the best sync and the best async trial against
wall-clock time on one chart."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from mlflow.entities import Metric, RunTag  # noqa: E402
from mlflow.utils.time import get_current_time_millis  # noqa: E402

from hetflow.paths import RunPaths  # noqa: E402
from hetflow.registry.live import tracked_run  # noqa: E402
from hetflow.registry.run_record import readable  # noqa: E402

# The MLflow status a trial's run ends with.
_RUN_STATUS = {"complete": "FINISHED", "pruned": "KILLED", "failed": "FAILED"}
ASYNC = ("parameter_server",)


def nest_trial(trial_paths: RunPaths, study_paths: RunPaths, study_id: str, number: int) -> None:
    """The trial's run under the study's (MLflow's nested runs)."""
    trial, study = tracked_run(trial_paths), tracked_run(study_paths)
    if trial is None or study is None:
        return
    client, run_id = trial
    tags = {"mlflow.parentRunId": study[1], "tuning.study": study_id, "tuning.trial": str(number)}
    client.log_batch(run_id, tags=[RunTag(key, value) for key, value in tags.items()])


def end_trial(trial_paths: RunPaths, record: dict[str, Any]) -> None:
    """The trial's state and figures on its run, which ends with the matching status."""
    tracked = tracked_run(trial_paths)
    if tracked is None:
        return
    client, run_id = tracked
    now = get_current_time_millis()
    figures = {"best_val_accuracy": record["best_accuracy"], "trial_wall_seconds": record["wall_seconds"]}
    if record["launch_to_target_seconds"] is not None:
        figures["launch_to_target_seconds"] = record["launch_to_target_seconds"]
    tags = [RunTag("tuning.state", record["state"])]
    if record.get("reason"):
        tags.append(RunTag("tuning.reason", record["reason"][:5000]))
    client.log_batch(run_id, metrics=[Metric(k, readable(v), now, 0) for k, v in figures.items()], tags=tags)
    client.set_terminated(run_id, _RUN_STATUS[record["state"]])


def _label(trial: dict[str, Any]) -> str:
    drawn = ", ".join(f"{key}={value}" for key, value in trial["params"].items())
    return f"#{trial['number']} {drawn}"


def comparison_plots(trials: list[dict[str, Any]], target: float, folder: Path) -> list[Path]:
    """time_to_target.png (a bar per trial: launch to target, or how it ended) and
    sync_vs_async.png (the best sync and best async trial's validation accuracy against seconds since launch)."""
    folder.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(9, 0.5 * len(trials) + 1.5))
    labels = [_label(t) for t in trials]
    seconds = [t["launch_to_target_seconds"] or 0.0 for t in trials]
    colors = ["tab:green" if t["launch_to_target_seconds"] is not None else "tab:gray" for t in trials]
    axes.barh(labels, seconds, color=colors)
    for row, trial in enumerate(trials):
        if trial["launch_to_target_seconds"] is None:
            axes.text(0, row, f"  {trial['state']}: best {trial['best_accuracy']:.3f}", va="center")
    axes.invert_yaxis()
    axes.set_xlabel(f"seconds from launch to validation accuracy {target}")
    axes.set_title("Time to target per trial")
    figure.tight_layout()
    bars = folder / "time_to_target.png"
    figure.savefig(bars, dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(8, 5))
    for kind, is_async in (("sync", False), ("async", True)):
        mine = [t for t in trials if (t["params"].get("strategy") in ASYNC) == is_async and t["curve"]]
        if mine:
            best = min(mine, key=lambda t: t["value"] if t["value"] is not None else float("inf"))
            times, accuracies = zip(*best["curve"])
            axes.plot(times, accuracies, marker=".", label=f"best {kind}: {_label(best)}")
    axes.axhline(target, color="gray", linestyle="--", label=f"target {target}")
    axes.set_xlabel("seconds since launch")
    axes.set_ylabel("validation accuracy")
    axes.set_title("Best sync and best async trial")
    axes.legend(fontsize=8)
    figure.tight_layout()
    curves = folder / "sync_vs_async.png"
    figure.savefig(curves, dpi=100)
    plt.close(figure)
    return [bars, curves]


def report_study(study_paths: RunPaths, trials: list[dict[str, Any]], target: float) -> None:
    """The comparison on the study's parent run: the trials' table, the two plots, the best figure."""
    tracked = tracked_run(study_paths)
    if tracked is None:
        return
    client, run_id = tracked
    table = {
        "trial": [t["number"] for t in trials],
        "state": [t["state"] for t in trials],
        "settings": [", ".join(f"{k}={v}" for k, v in t["params"].items()) for t in trials],
        "launch_to_target_seconds": [t["launch_to_target_seconds"] for t in trials],
        "best_val_accuracy": [t["best_accuracy"] for t in trials],
        "wall_seconds": [t["wall_seconds"] for t in trials],
        "run_id": [t["run_id"] for t in trials],
    }
    client.log_dict(run_id, table, "trials.json")  # rewritten whole on a retry: no row twice
    with tempfile.TemporaryDirectory(prefix="hetflow-study-") as folder:
        for plot in comparison_plots(trials, target, Path(folder)):
            client.log_artifact(run_id, str(plot), "comparison")
    now = get_current_time_millis()
    reached = [t["launch_to_target_seconds"] for t in trials if t["launch_to_target_seconds"] is not None]
    counts = {state: sum(t["state"] == state for t in trials) for state in _RUN_STATUS}
    metrics = [Metric(f"trials_{state}", float(n), now, 0) for state, n in counts.items()]
    if reached:
        metrics.append(Metric("best_launch_to_target_seconds", readable(min(reached)), now, 0))
    note = RunTag("mlflow.note.content", _trials_table(trials, target))
    client.log_batch(run_id, metrics=metrics, tags=[note])


# Ends the paragraph report_winner puts above the trials table (a retry replaces it).
_WINNER_END = "\n\n---\n\n"


def report_winner(study_paths: RunPaths, best_trial: int, registry: dict[str, Any], test_accuracy: float) -> None:
    """On the study's parent run, above its trials table: the trial that went on to evaluate, compress,
    export and register, its test accuracy (also as the run's ``test_accuracy``, the runs table's
    column, which showed "-"), and each registered version with its aliases and the gate's decision."""
    tracked = tracked_run(study_paths)
    if tracked is None:
        return
    client, run_id = tracked
    lines = [f"**Trial {best_trial} went on to register**, test accuracy {test_accuracy:.4f}:"]
    for model in registry["models"]:
        aliases = ", ".join(model["aliases"]) or "no alias"
        lines.append(f"- {model['model_name']} v{model['version']} ({aliases}): {model['gate']}")
    note = client.get_run(run_id).data.tags.get("mlflow.note.content", "")
    table = note.split(_WINNER_END, 1)[-1]
    tags = {
        "mlflow.note.content": "\n".join(lines) + _WINNER_END + table,
        "tuning.registered_trial": str(best_trial),
        "registry.gate": registry["models"][0]["gate"][:5000],
    }
    metric = Metric("test_accuracy", readable(test_accuracy), get_current_time_millis(), 0)
    client.log_batch(run_id, metrics=[metric], tags=[RunTag(key, value) for key, value in tags.items()])


def _trials_table(trials: list[dict[str, Any]], target: float) -> str:
    """The trials as a fixed-width table in a code block, for the top of the study's MLflow page
    (MLflow renders a Markdown table's cells without padding; a code block keeps its columns)."""
    header = ["trial", "state", "to target s", "best val acc", "settings"]
    rows = [
        [
            str(t["number"]),
            t["state"],
            "" if t["launch_to_target_seconds"] is None else f"{t['launch_to_target_seconds']:.1f}",
            f"{t['best_accuracy']:.4f}",
            ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t["params"].items()),
        ]
        for t in sorted(trials, key=lambda t: (t["value"] is None, t["value"] or 0.0))
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]
    intro = f"Trials to validation accuracy {target}, fastest first (seconds from launch; the charts: `comparison/`)."
    return "\n\n".join([intro, "\n".join(["```", *lines, "```"])])

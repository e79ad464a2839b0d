"""What the MLflow run of a DAG run holds: tags, params, per-epoch curves, final metrics, the run's
records, logs and plots as artifacts, the dataset input, TensorBoard events, the served checks.
Safe to repeat: a retried register task logs no second copy of a curve."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from mlflow.entities import Metric, Param, RunTag
from mlflow.utils.time import get_current_time_millis

from hetflow.cluster.supervisor import read_restarts
from hetflow.paths import NotRegularFile, RunPaths, read_regular
from hetflow.records import DatasetRecord, EvaluationRecord, ExportRecord
from hetflow.registry import lineage
from hetflow.registry.store import git_commit
from hetflow.replica.balance import measured
from hetflow.replica.training_json import TrainingRecord
from hetflow.serving import server as serving
from hetflow.spec import RunSpec
from hetflow.spec.run_spec import BY_SHORT
from mlflow import MlflowClient

MAX_METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch call
# A log or record uploaded to the run: far above what a run writes, far below filling the store.
MAX_UPLOAD_BYTES = 64 << 20

log = logging.getLogger("hetflow.registry")


def pipeline_started(paths: RunPaths) -> float | None:
    """When the run's first stage started (unix time), from its receipt; None without one."""
    receipt = paths.attempt("validate_spec")
    timing = json.loads(receipt.read_text()).get("timing") if receipt.exists() else None
    return timing["started_at"] if timing else None


# Strategies as a run's name says them: what a reader compares, in a word.
_STRATEGY_WORDS = {
    "auto": "auto",
    "one_device": "one-device",
    "mirrored": "mirrored",
    "multi_worker_mirrored": "sync",
    "parameter_server": "async",
    "model_parallel": "model-parallel",
}
# The keys a run's name says in words (its dataset; its strategy and replicas), not as key=value.
_CLUSTER_SHAPE = ("strategy", "workers", "devices_per_worker", "ps")
# Longest a name's key=value part gets; MLflow keeps 250 characters, its lists show about 30.
_CHANGED_CHARS = 120
# The order of a name's key=value settings, by the spec's sections: what changes what is learnt
# first (a run of 5 epochs), how it ran and where it is registered last.
_SECTIONS_FIRST = ("Training", "Model", "Data", "Compression", "Export", "Cluster", "Registry")


def run_name(spec: RunSpec, started: float | None) -> str:
    """What tells the run apart, then its start time (UTC): the keys set away from their defaults,
    the dataset and the cluster's shape in words, e.g. ``async 2w+1ps epochs=5
    13:21:22``; ``defaults 13:21:22`` where none was. MLflow's chart legends cut a name after about 24
    characters, so what differs goes first: runs named by their whole configuration (dataset,
    strategy, replicas, model) differed in the time alone, which the legends cut off. The settings go
    by section, training's first: ``sync 2w epochs=1000 train_timeout_seconds=120 …``."""
    # The defaults of a run on this dataset: some follow it (the registered model's name).
    defaults = RunSpec.from_values({"dataset": spec.data.dataset}).flat()
    changed = {key: value for key, value in spec.flat().items() if value != defaults[key]}
    words = []
    if spec.data.dataset != RunSpec().data.dataset:  # a folder dataset by its folder's name
        words.append(spec.data.dataset.removeprefix("folder:").rstrip("/").rsplit("/", 1)[-1])
    if changed.keys() & set(_CLUSTER_SHAPE):
        words.append(f"{_STRATEGY_WORDS[spec.cluster.strategy]} {_replicas(spec)}")
    named = sorted(
        (key for key in changed if key not in ("dataset", *_CLUSTER_SHAPE)),
        key=lambda key: _SECTIONS_FIRST.index(BY_SHORT[key].section),
    )
    settings = " ".join(f"{key}={_setting(changed[key])}" for key in named)
    if len(settings) > _CHANGED_CHARS:
        settings = settings[: _CHANGED_CHARS - 1].rstrip() + "…"
    when = datetime.fromtimestamp(started if started is not None else time.time(), timezone.utc)
    parts = [*words, settings] if settings else words
    return " ".join([*(parts or ["defaults"]), f"{when:%H:%M:%S}"])


def _replicas(spec: RunSpec) -> str:
    """The cluster in a word: ``2w``, ``1wx2dev``, ``2w+1ps``."""
    replicas = f"{spec.cluster.worker.replicas}w"
    if spec.cluster.worker.devices > 1:
        replicas += f"x{spec.cluster.worker.devices}dev"
    if spec.cluster.ps.replicas:
        replicas += f"+{spec.cluster.ps.replicas}ps"
    return replicas


def _setting(value) -> str:
    """A key's value as a person types it after ``--set key=``."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(_setting, value))
    return str(value)


def as_computed(value: float) -> float:
    """A curve's point at the precision it was computed in: Keras and TensorFlow compute in float32,
    and a float32 widened to a double shows its binary tail in MLflow (0.001 as
    0.0010000000474974513); this is the shortest decimal that is the same float32 (0.001). A figure
    measured as a double (epoch seconds) keeps 7 significant digits, more than the clock resolves."""
    return float(str(np.float32(value)))


def _stepped_metrics(training: TrainingRecord, logged: dict[str, set[int]]) -> list[Metric]:
    """Metrics with a step: the per-epoch history (loss, accuracy, val_*), epoch time and learning
    rate (step = epoch), and under async training the staleness histogram (step = staleness,
    value = updates that saw it). Steps in ``logged`` (by metric: what training logged live, or an
    earlier try of register) are left out, so that no curve gets a second copy of a point."""
    now = get_current_time_millis()
    series = {
        name if name.startswith("val_") else f"train_{name}": values for name, values in dict(training.history).items()
    }
    series["epoch_seconds"] = training.epoch_seconds
    series["learning_rate"] = training.learning_rate_per_epoch
    metrics = [
        Metric(name, as_computed(value), now, epoch)
        for name, values in series.items()
        for epoch, value in enumerate(values, start=1)
        if epoch not in logged.get(name, set())
    ]
    if training.staleness and not logged.get("staleness_updates"):
        histogram = training.staleness.histogram
        metrics += [Metric("staleness_updates", count, now, int(stale)) for stale, count in histogram.items()]
    return metrics


_STEPPED = ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "epoch_seconds", "learning_rate")


def _summary_metrics(training: TrainingRecord, evaluation: EvaluationRecord) -> dict[str, float]:
    """One value per run: test scores, speed, and per-worker speed and share of the steps."""
    metrics = {
        "test_loss": evaluation.test_loss,
        "test_accuracy": evaluation.test_accuracy,
        "train_seconds": training.train_seconds,
        "examples_per_second": training.examples_per_second,
        "time_to_first_step_seconds": training.time_to_first_step_seconds,
    }
    for worker, numbers in training.per_worker.items():
        for key, value in numbers.model_dump(exclude_unset=True).items():
            if not isinstance(value, list):  # a model_parallel stage's layers are in training.json
                metrics[f"{worker.replace('-', '_')}_{key}"] = value
    if training.seconds_to_target is not None:
        metrics["seconds_to_target_accuracy"] = training.seconds_to_target
    if training.staleness:
        metrics["staleness_mean"] = training.staleness.mean
        metrics["staleness_max"] = training.staleness.max
    # None where nothing was measured (a retry that had no epoch left to train).
    return {name: value for name, value in metrics.items() if value is not None}


def readable(value: float) -> float:
    """A run's figure as MLflow's tables show it: a float to 4 significant digits (0.9610, 2.481,
    13570), which tells runs apart at the precision they were measured (an accuracy is a count of
    a few hundred test examples); MLflow shows every digit it gets, and 16-digit floats filled the
    runs table's columns. The run's records (summary.json, evaluation.json) keep every digit."""
    return float(f"{value:.4g}") if isinstance(value, float) else value


def headline(training: TrainingRecord, evaluation: EvaluationRecord, airflow_url: str | None = None) -> str:
    """The run's description, at the top of its MLflow page: the figures a reviewer compares first
    (MLflow lists metrics alphabetically, epoch_seconds and export_* before the accuracies), and the
    way back to the Airflow run that made it."""
    last_epoch = {name: values[-1] for name, values in dict(training.history).items() if values}
    parts = [f"**test accuracy {evaluation.test_accuracy:.4f}**"]
    if "val_accuracy" in last_epoch:
        parts.append(f"validation accuracy {last_epoch['val_accuracy']:.4f}")
    parts.append(f"test loss {evaluation.test_loss:.4f}")
    speed, seconds = training.examples_per_second, training.train_seconds
    if speed is not None and seconds is not None:
        parts.append(f"{speed:.0f} examples/s in training ({seconds:.1f} s)")
    link = f"\n\n[The Airflow run]({airflow_url}): its tasks and their logs." if airflow_url else ""
    return " · ".join(parts) + link


def _export_metrics(exported: ExportRecord) -> dict[str, float]:
    """Per exported artifact: size raw and gzipped, test accuracy, agreement, latency."""
    metrics = {}
    for name, artifact in exported.artifacts.items():
        for key in ("bytes", "gzip_bytes", "test_accuracy", "agreement_with_float", "latency_ms"):
            metrics[f"export_{name}_{key}"] = getattr(artifact, key)
    return metrics


def log_run_record(
    client: MlflowClient,
    run_id: str,
    spec: RunSpec,
    paths: RunPaths,
    dataset: DatasetRecord,
    training: TrainingRecord,
    evaluation: EvaluationRecord,
    exported: ExportRecord,
) -> None:
    """Tags, params, curves, final metrics and artifacts of the run; safe to repeat on retry."""
    tags = {
        "dataset.name": dataset.name,
        "dataset.version": dataset.version,
        "dataset.fingerprint": dataset.fingerprint,
        "dataset.source": dataset.source_path,
        "mlflow.source.git.commit": git_commit(),
        "mlflow.note.content": headline(training, evaluation, client.get_run(run_id).data.tags.get("airflow.url")),
        "strategy": spec.cluster.strategy,
    }
    params = {
        **spec.flat(),
        "effective_steps_per_epoch": training.steps_per_epoch,
        "replicas_in_sync": training.replicas_in_sync,
        "per_replica_batch": training.per_replica_batch,
    }
    summary = {**_summary_metrics(training, evaluation), **_export_metrics(exported)}
    restarts = read_restarts(paths)
    if restarts:  # restart_policy restarted replicas
        summary["restarts"] = len(restarts)
        tags["restarts"] = "; ".join(
            f"{r['replica']} exited {r['exit_code']} ({r['cause']}): {r['action']}" for r in restarts
        )[:5000]
    plan = measured(paths, spec)  # the workers were probed (strategy=auto, or balance_batches by the workers)
    if plan is not None:
        params["requested_strategy"] = plan.requested.cluster.strategy
        for probe in plan.probes:
            summary[f"probe_{probe.worker.replace('-', '_')}_examples_per_second"] = probe.examples_per_second
        if plan.decision is not None:
            tags["auto.decision"] = plan.decision.reason
        if plan.worker_batches is not None and spec.cluster.worker.balance_batches:  # else they trained equal
            params["worker_batches"] = plan.worker_batches
    now = get_current_time_millis()
    metrics = [Metric(key, readable(value), now, 0) for key, value in summary.items()]
    logged = {
        name: {metric.step for metric in client.get_metric_history(run_id, name)}
        for name in (*_STEPPED, "staleness_updates")
    }
    metrics += _stepped_metrics(training, logged)
    client.log_batch(
        run_id,
        params=[Param(key, str(value)) for key, value in params.items()],
        tags=[RunTag(key, value) for key, value in tags.items()],
    )
    for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])
    records = [paths.spec, paths.dataset, paths.training, paths.evaluation, paths.compression, paths.export]
    upload_regular_files(client, run_id, [*records, *(p for p in (paths.plan, paths.restarts) if p.exists())], "run")
    upload_regular_files(client, run_id, [paths.logs], "logs")
    upload_regular_files(client, run_id, [paths.plots], "plots")
    lineage.log_dataset(client, run_id, dataset)
    events = lineage.write_tensorboard_events(training, paths.tensorboard)
    upload_regular_files(client, run_id, [events], "tensorboard")


def upload_regular_files(client: MlflowClient, run_id: str, sources: list[Path], artifact_path: str) -> list[str]:
    """Upload files, and the files in folders, under ``artifact_path``: regular files only, read
    without following a link (MLflow's own copy follows them: a log planted as a link to a secret
    would be uploaded), each at most ``MAX_UPLOAD_BYTES``; anything else is left out with a warning
    naming it. Returns what was uploaded, relative to ``artifact_path``."""
    uploaded = []
    with tempfile.TemporaryDirectory(prefix="hetflow-upload-") as staging:
        for source in sources:
            if source.is_dir() and not source.is_symlink():
                found = [(path, path.relative_to(source)) for path in _entries(source)]
            else:
                found = [(source, Path(source.name))]
            for path, relative in found:
                try:
                    content = read_regular(path, MAX_UPLOAD_BYTES)
                except (NotRegularFile, OSError) as refused:
                    log.warning("not uploaded to the MLflow run: %s", refused)
                    continue
                target = Path(staging) / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
                uploaded.append(str(relative))
        if uploaded:
            client.log_artifacts(run_id, staging, artifact_path)
    return uploaded


def _entries(folder: Path) -> list[Path]:
    """Everything under ``folder`` that is not a directory it can enter (links are listed, never
    followed)."""
    entries = []
    for parent, directories, files in os.walk(folder):
        entries += [Path(parent) / name for name in files]
        entries += [Path(parent) / name for name in directories if (Path(parent) / name).is_symlink()]
    return sorted(entries)


def log_served_checks(client: MlflowClient, run_id: str, models: list[dict], log_dir: Path) -> None:
    """Each served check in the run: result tag, agreement and latency metrics, the servers' logs."""
    now = get_current_time_millis()
    metrics, tags = [], []
    for kind, model in zip(("float", "tflite"), models):
        served = model["served"]
        if served is None:  # decided by a version of hetflow that did not serve
            continue
        tags.append(RunTag(f"served.{kind}", serving.describe(served)[:5000]))
        metrics.append(Metric(f"served_{kind}_passed", float(served["passed"]), now, 0))
        for key in ("agreement", "max_logit_difference", "latency_p50_ms", "latency_p99_ms", "start_seconds"):
            if key in served:
                metrics.append(Metric(f"served_{kind}_{key}", served[key], now, 0))
    client.log_batch(run_id, metrics=metrics, tags=tags)
    if log_dir.exists():
        upload_regular_files(client, run_id, [log_dir], "serving")
    tag_registered(client, run_id)


# The runs table's column of what a run registered (hetflow's saved view shows it).
REGISTERED_TAG = "registered"


def tag_registered(client: MlflowClient, run_id: str) -> None:
    """Tag the run with the versions it registered and the aliases they hold now, e.g.
    ``hetflow-digits v3 @champion @candidate · -tflite v3 @candidate``, and tag again every run whose
    tag named an alias: the gate moves aliases from an earlier run's versions, whose tag would lie."""
    experiment_id = client.get_run(run_id).info.experiment_id
    holders = client.search_runs([experiment_id], f"tags.`{REGISTERED_TAG}` LIKE '%@%'")
    for run in dict.fromkeys([run_id, *(found.info.run_id for found in holders)]):
        client.set_tag(run, REGISTERED_TAG, _registered_versions(client, run))


def _registered_versions(client: MlflowClient, run_id: str) -> str:
    """A run's versions, each with its aliases (champion first); a name that extends the first by a
    suffix (the TFLite model's) by that suffix."""
    versions = sorted(client.search_model_versions(f"run_id = '{run_id}'"), key=lambda v: (len(v.name), v.name))
    parts = []
    for version in versions:
        held_by = client.get_registered_model(version.name).aliases.items()
        aliases = sorted(held_by, key=lambda alias: (alias[0] != "champion", alias[0]))
        name = version.name
        if parts and name.startswith(versions[0].name):
            name = name.removeprefix(versions[0].name)
        held = "".join(f" @{alias}" for alias, number in aliases if str(number) == str(version.version))
        parts.append(f"{name} v{version.version}{held}")
    return " · ".join(parts)

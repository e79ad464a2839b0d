"""register: one MLflow run per DAG run, the model registered, and the champion gate.

Every MLflow write of a run happens here, in one process, after training: replicas never talk to
MLflow, so several processes never interleave metrics or clash on params, and training does not
depend on the tracking server being up. A retried task finds the run and the version it already
made (by the Airflow run id) and creates neither twice.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.time import get_current_time_millis

import mlflow
from mlflow import MlflowClient
from tasks.paths import REPO_ROOT, RunPaths
from tasks.spec import RunSpec

log = logging.getLogger("hetflow.registry")

EXPERIMENT = "hetflow"
CANDIDATE, CHAMPION = "candidate", "champion"
_MAX_METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch call


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{REPO_ROOT / 'mlflow' / 'mlflow.db'}"


def _experiment_id(client: MlflowClient) -> str:
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment:
        return experiment.experiment_id
    uri = tracking_uri()
    # A SQLite store keeps artifacts beside its database; a tracking server decides for itself.
    location = Path(uri.removeprefix("sqlite:///")).parent / "artifacts" if uri.startswith("sqlite:///") else None
    return client.create_experiment(EXPERIMENT, artifact_location=location.as_uri() if location else None)


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def find_or_create_run(client: MlflowClient, dag_id: str, airflow_run_id: str, run_name: str) -> str:
    experiment_id = _experiment_id(client)
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`airflow.dag_id` = '{dag_id}' and tags.`airflow.run_id` = '{airflow_run_id}'",
        max_results=1,
    )
    if found:
        return found[0].info.run_id
    run = client.create_run(
        experiment_id, run_name=run_name, tags={"airflow.dag_id": dag_id, "airflow.run_id": airflow_run_id}
    )
    return run.info.run_id


def _stepped_metrics(training: dict) -> list[Metric]:
    """Metrics with a step: the per-epoch history (loss, accuracy, val_*), epoch time and learning
    rate (step = epoch), and under async training the staleness histogram (step = staleness,
    value = updates that saw it)."""
    now = get_current_time_millis()
    series = {
        name if name.startswith("val_") else f"train_{name}": values for name, values in training["history"].items()
    }
    series["epoch_seconds"] = training["epoch_seconds"]
    series["learning_rate"] = training["learning_rate_per_epoch"]
    metrics = [
        Metric(name, value, now, epoch)
        for name, values in series.items()
        for epoch, value in enumerate(values, start=1)
    ]
    if "staleness" in training:
        histogram = training["staleness"]["histogram"]
        metrics += [Metric("staleness_updates", count, now, int(stale)) for stale, count in histogram.items()]
    return metrics


def _summary_metrics(training: dict, evaluation: dict) -> dict[str, float]:
    """One value per run: test scores, speed, and per-worker speed and share of the steps."""
    metrics = {
        "test_loss": evaluation["test_loss"],
        "test_accuracy": evaluation["test_accuracy"],
        "train_seconds": training["train_seconds"],
        "examples_per_second": training["examples_per_second"],
        "time_to_first_step_seconds": training["time_to_first_step_seconds"],
    }
    for worker, numbers in training["per_worker"].items():
        for key, value in numbers.items():
            metrics[f"{worker.replace('-', '_')}_{key}"] = value
    if "staleness" in training:
        metrics["staleness_mean"] = training["staleness"]["mean"]
        metrics["staleness_max"] = training["staleness"]["max"]
    return metrics


def log_run_record(
    client: MlflowClient, run_id: str, spec: RunSpec, paths: RunPaths, dataset: dict, training: dict, evaluation: dict
) -> None:
    """Tags, params, curves, final metrics and artifacts of the run; safe to repeat on retry."""
    tags = {
        "dataset.name": dataset["name"],
        "dataset.version": dataset["version"],
        "dataset.fingerprint": dataset["fingerprint"],
        "mlflow.source.git.commit": _git_commit(),
        "strategy": spec.strategy,
    }
    params = {
        **spec.model_dump(),
        "effective_steps_per_epoch": training["steps_per_epoch"],
        "replicas_in_sync": training["replicas_in_sync"],
        "per_replica_batch": training["per_replica_batch"],
    }
    now = get_current_time_millis()
    metrics = [Metric(key, value, now, 0) for key, value in _summary_metrics(training, evaluation).items()]
    # A retried task must not append a second copy of the per-epoch history.
    if not client.get_metric_history(run_id, "train_loss"):
        metrics += _stepped_metrics(training)
    client.log_batch(
        run_id,
        params=[Param(key, str(value)) for key, value in params.items()],
        tags=[RunTag(key, value) for key, value in tags.items()],
    )
    for start in range(0, len(metrics), _MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metrics[start : start + _MAX_METRICS_PER_BATCH])
    for path in (paths.spec, paths.dataset, paths.training, paths.evaluation):
        client.log_artifact(run_id, str(path), "run")
    client.log_artifacts(run_id, str(paths.logs), "logs")
    client.log_artifacts(run_id, str(paths.plots), "plots")


def _version_by_alias(client: MlflowClient, name: str, alias: str):
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def _register_model(client: MlflowClient, run_id: str, spec: RunSpec, paths: RunPaths, dataset: dict):
    """Log the model into the run and register it, or return the version a previous try made."""
    existing = client.search_model_versions(f"name='{spec.registered_model}' and run_id='{run_id}'")
    if existing:
        log.info(
            "run %s already registered %s version %s: re-using it", run_id, spec.registered_model, existing[0].version
        )
        return existing[0]
    import tensorflow as tf
    from mlflow.models import infer_signature

    from tasks.data.pipeline import split_arrays

    model = tf.keras.models.load_model(paths.model)
    images, _ = split_arrays(dataset, "test")
    example = images[:5]
    with mlflow.start_run(run_id=run_id):
        info = mlflow.tensorflow.log_model(
            model,
            name="model",
            signature=infer_signature(example, model.predict(example, verbose=0)),
            input_example=example,
            registered_model_name=spec.registered_model,
        )
    return client.get_model_version(spec.registered_model, str(info.registered_model_version))


def champion_accuracy(client: MlflowClient, champion, dataset: dict) -> float:
    """The champion's test accuracy on *this* run's test split.

    Its recorded accuracy counts when it was measured on the same prepared data (same dataset
    fingerprint); otherwise the champion is loaded and scored on this test split.
    """
    if champion.tags.get("dataset.fingerprint") == dataset["fingerprint"]:
        return float(champion.tags["test_accuracy"])
    import numpy as np

    from tasks.data.pipeline import split_arrays

    images, labels = split_arrays(dataset, "test")
    model = mlflow.pyfunc.load_model(f"models:/{champion.name}/{champion.version}")
    return float(np.mean(np.argmax(np.asarray(model.predict(images)), axis=1) == labels))


def gate(spec: RunSpec, candidate_accuracy: float, champion, champion_score: float | None) -> dict[str, Any]:
    """Whether the candidate takes ``champion``: when there is none, or it beats it by min_improvement."""
    if champion is None:
        return {"promote": True, "reason": "no champion yet"}
    margin = candidate_accuracy - champion_score
    promote = margin >= spec.min_improvement
    verb = "beats" if promote else "does not beat"
    return {
        "promote": promote,
        "reason": (
            f"test accuracy {candidate_accuracy:.4f} {verb} champion v{champion.version} "
            f"({champion_score:.4f}) by min_improvement {spec.min_improvement} (margin {margin:+.4f})"
        ),
    }


def register(spec: RunSpec, paths: RunPaths, dataset: dict, dag_id: str, airflow_run_id: str) -> dict[str, Any]:
    """Record the run in MLflow, register the model, move the aliases; writes registry.json."""
    training = json.loads(paths.training.read_text())
    evaluation = json.loads(paths.evaluation.read_text())
    mlflow.set_tracking_uri(tracking_uri())
    client = MlflowClient()
    run_id = find_or_create_run(client, dag_id, airflow_run_id, run_name=paths.root.name)
    log_run_record(client, run_id, spec, paths, dataset, training, evaluation)

    version = _register_model(client, run_id, spec, paths, dataset)
    name, accuracy = spec.registered_model, evaluation["test_accuracy"]
    for key, value in {
        "airflow.run_id": airflow_run_id,
        "dataset.name": dataset["name"],
        "dataset.fingerprint": dataset["fingerprint"],
        "strategy": spec.strategy,
        "test_accuracy": repr(accuracy),
    }.items():
        client.set_model_version_tag(name, version.version, key, value)
    client.set_registered_model_alias(name, CANDIDATE, version.version)

    champion = _version_by_alias(client, name, CHAMPION)
    if champion is not None and champion.version == version.version:
        decision = {"promote": True, "reason": "already champion (task retried)"}
    else:
        score = champion_accuracy(client, champion, dataset) if champion is not None else None
        decision = gate(spec, accuracy, champion, score)
        if decision["promote"]:
            client.set_registered_model_alias(name, CHAMPION, version.version)
    log.info("gate: %s -> %s", decision["reason"], "champion" if decision["promote"] else "stays candidate")
    client.update_model_version(
        name,
        version.version,
        description=(
            f"Trained by Airflow run `{airflow_run_id}` ({spec.strategy}, {spec.model}) on "
            f"{dataset['name']} {dataset['version']}.\n\n- test accuracy: {accuracy:.4f}\n- gate: {decision['reason']}"
        ),
    )
    client.set_tag(run_id, "registry.gate", decision["reason"])

    aliases = client.get_model_version(name, version.version).aliases
    record = {
        "model_name": name,
        "version": int(version.version),
        "model_uri": f"models:/{name}/{version.version}",
        "aliases": sorted(aliases),
        "promoted": decision["promote"],
        "gate": decision["reason"],
        "mlflow_run_id": run_id,
        "mlflow_tracking_uri": tracking_uri(),
    }
    paths.registry.write_text(json.dumps(record, indent=2))
    return record

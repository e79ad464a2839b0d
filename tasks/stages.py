"""The stages of ``hetflow_train``: plain functions of the Airflow run id, no Airflow import.

Each stage reads what earlier stages wrote in the run directory and writes its own file there, so
any stage can be re-run (an Airflow retry) or run outside Airflow (``hetflow train``, tests).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tasks.paths import RunPaths, data_dir, run_paths
from tasks.spec import RunSpec, parse_spec

log = logging.getLogger("hetflow.stages")

# (stage, the file it leaves behind), in DAG order: the first missing file names the failed stage.
STAGE_OUTPUTS = (
    ("validate_spec", "spec"),
    ("prepare_data", "dataset"),
    ("provision_cluster", "cluster"),
    ("train", "training"),
    ("evaluate", "evaluation"),
    ("compress", "compression"),
    ("export", "export"),
    ("register", "registry"),
)


def _read(path) -> Any:
    return json.loads(path.read_text())


def load_spec(paths: RunPaths) -> RunSpec:
    return RunSpec.model_validate_json(paths.spec.read_text())


def validate_spec(values: dict[str, Any], run_id: str) -> dict[str, Any]:
    """Validate the run's conf (form values plus any extra keys); nothing starts when it is invalid."""
    spec = parse_spec(values)
    paths = run_paths(run_id)
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.spec.write_text(spec.model_dump_json(indent=2))
    log.info("spec: %s", spec.model_dump())
    return spec.model_dump()


def prepare_data(run_id: str) -> dict[str, Any]:
    from tasks.data.prepare import prepare_dataset

    paths = run_paths(run_id)
    record = prepare_dataset(load_spec(paths).dataset, data_dir())
    paths.dataset.write_text(json.dumps(record, indent=2))
    log.info(
        "dataset %s %s %s (fingerprint %s)",
        record["name"],
        record["version"],
        "re-used" if record["reused"] else "prepared",
        record["fingerprint"][:12],
    )
    return record


def provision_cluster(run_id: str) -> dict[str, Any]:
    from tasks.cluster import backends

    paths = run_paths(run_id)
    spec = load_spec(paths)
    if spec.strategy == "auto":  # balance_batches alone: the workers probe themselves when they start
        from tasks.auto import plan_training

        spec = plan_training(spec, run_id, paths)
        # From here on the run trains with the resolved spec; the request stays in plan.json.
        paths.spec.write_text(spec.model_dump_json(indent=2))
    layout = backends.plan(spec, run_id)
    paths.cluster.write_text(json.dumps(layout.to_dict(), indent=2))
    log.info("cluster: %s", layout.cluster_spec())
    return layout.to_dict()


def train(run_id: str) -> dict[str, Any]:
    """Start the replicas, stream their output here, wait for all; this process only supervises."""
    from tasks.cluster import backends
    from tasks.cluster.layout import ClusterLayout

    paths = run_paths(run_id)
    spec = load_spec(paths)
    cluster = backends.make_cluster(spec, ClusterLayout.from_dict(_read(paths.cluster)), paths.root, paths.logs)
    try:
        cluster.start()
        cluster.wait(timeout=spec.train_timeout_seconds)
    finally:
        cluster.stop()
    return _read(paths.training)


def teardown_cluster(run_id: str) -> list:
    """End what is left of the run's replicas: pids (local), containers (docker), pods (kubernetes)."""
    from tasks.cluster import backends

    paths = run_paths(run_id)
    ended = backends.teardown(load_spec(paths) if paths.spec.exists() else None, run_id)
    log.info("teardown: %s", f"ended {ended}" if ended else "no replica was left running")
    return ended


def evaluate(run_id: str) -> dict[str, Any]:
    from tasks.evaluate import evaluate as evaluate_model

    paths = run_paths(run_id)
    result = evaluate_model(paths, _read(paths.dataset))
    log.info("test accuracy %.4f, loss %.4f", result["test_accuracy"], result["test_loss"])
    return {k: v for k, v in result.items() if k != "confusion_matrix"}


def compress(run_id: str) -> dict[str, Any]:
    from tasks.compress import compress as compress_model

    paths = run_paths(run_id)
    record = compress_model(load_spec(paths), paths, _read(paths.dataset))
    log.info("compressed variants: %s; kernel sparsity %s", list(record["variants"]), record.get("kernel_sparsity"))
    return record


def export(run_id: str) -> dict[str, Any]:
    from tasks.export import export as export_artifacts

    paths = run_paths(run_id)
    record = export_artifacts(load_spec(paths), paths, _read(paths.dataset))
    for name, artifact in record["artifacts"].items():
        log.info(
            "%s: accuracy %.4f (drop %+.4f), %d bytes (%d gzipped), %.4f ms/example%s",
            name,
            artifact["test_accuracy"],
            artifact["accuracy_drop"],
            artifact["bytes"],
            artifact["gzip_bytes"],
            artifact["latency_ms"],
            "" if artifact["accepted"] else f" -- rejected: {artifact['reason']}",
        )
    return {"chosen_tflite": record["chosen_tflite"], "float_test_accuracy": record["float_test_accuracy"]}


class TrackingUnavailable(RuntimeError):
    pass


def register(run_id: str, dag_id: str) -> dict[str, Any]:
    """Everything to MLflow. MLflow's client retries with backoff (MLFLOW_HTTP_REQUEST_MAX_RETRIES,
    MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR); when the server stays away the task fails saying so, and
    the run's files stay in place for a retry of this task."""
    import requests
    from mlflow.exceptions import MlflowException

    from tasks.registry import register as register_model
    from tasks.registry import tracking_uri

    paths = run_paths(run_id)
    try:
        return register_model(load_spec(paths), paths, _read(paths.dataset), dag_id, run_id)
    except (MlflowException, requests.exceptions.RequestException) as error:
        reason = str(error).splitlines()[0][:300]
        raise TrackingUnavailable(
            f"MLflow at {tracking_uri()} failed: {reason}; the trained model and every stage's files are kept "
            f"in {paths.root}: retry the register task once MLflow is reachable"
        ) from error


def summarize(run_id: str) -> dict[str, Any]:
    """Write summary.json from whatever the stages left; status is ``failed`` if any stage did not finish."""
    paths = run_paths(run_id)
    outputs = {name: getattr(paths, attr) for name, attr in STAGE_OUTPUTS}
    failed_stage = next((name for name, path in outputs.items() if not path.exists()), None)
    read = {name: _read(path) if path.exists() else None for name, path in outputs.items()}
    training, evaluation, registry = read["train"] or {}, read["evaluate"] or {}, read["register"] or {}
    exported = (read["export"] or {}).get("artifacts", {})
    dataset = read["prepare_data"] or {}
    summary = {
        "run_id": run_id,
        "status": "failed" if failed_stage else "success",
        "failed_stage": failed_stage,
        "run_dir": str(paths.root),
        "spec": read["validate_spec"],
        "dataset": {k: dataset.get(k) for k in ("name", "version", "fingerprint", "splits")},
        "mlflow_tracking_uri": registry.get("mlflow_tracking_uri"),
        "mlflow_run_id": registry.get("mlflow_run_id"),
        "metrics": {
            "test_accuracy": evaluation.get("test_accuracy"),
            "test_loss": evaluation.get("test_loss"),
            "train_seconds": training.get("train_seconds"),
            "examples_per_second": training.get("examples_per_second"),
            "time_to_first_step_seconds": training.get("time_to_first_step_seconds"),
        },
        "artifacts": {
            "model": {"path": str(paths.model), "bytes": paths.model.stat().st_size} if paths.model.exists() else None,
            "exported": {
                name: {k: a[k] for k in ("path", "bytes", "gzip_bytes", "test_accuracy", "accepted")}
                for name, a in exported.items()
            },
            "chosen_tflite": (read["export"] or {}).get("chosen_tflite"),
            "replica_logs": sorted(str(p) for p in paths.logs.glob("*.log")),
            "plots": sorted(str(p) for p in paths.plots.glob("*.png")),
        },
        "registry": {
            k: registry.get(k) for k in ("model_name", "version", "model_uri", "aliases", "promoted", "gate", "models")
        }
        if registry
        else None,
    }
    paths.summary.write_text(json.dumps(summary, indent=2))
    if failed_stage:
        raise RuntimeError(f"run {run_id} failed at stage {failed_stage}; summary: {paths.summary}")
    return summary

"""register: one MLflow run per DAG run, the model registered, and the champion gate.

Every MLflow write of a run happens here, in one process, after training: replicas never talk to
MLflow, so several processes never interleave metrics or clash on params, and training does not
depend on the tracking server being up. A retried task finds the run and the version it already
made (by the Airflow run id) and creates neither twice.

Registries are shared: hetflow registers only into registered models it created (they carry
``OWNER_TAG``), and moves ``champion`` under one lock per registered model, so that concurrent
runs compare against the champion as it is when they set the alias.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.models import infer_signature
from mlflow.protos.databricks_pb2 import ALREADY_EXISTS, RESOURCE_ALREADY_EXISTS, ErrorCode
from mlflow.utils.time import get_current_time_millis

import mlflow
from mlflow import MlflowClient
from tasks import lineage, serving, timings
from tasks.paths import REPO_ROOT, RunPaths, hetflow_home, write_record
from tasks.spec import RunSpec

log = logging.getLogger("hetflow.registry")

EXPERIMENT = "hetflow"
CANDIDATE, CHAMPION = "candidate", "champion"
_MAX_METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch call
OWNER_TAG, OWNER = "hetflow.created_by", "hetflow"  # set on every registered model hetflow creates


class ForeignRegisteredModel(ValueError):
    """The registered model name belongs to a model hetflow did not create."""


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
    if training.get("staleness"):
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
    if training.get("seconds_to_target") is not None:
        metrics["seconds_to_target_accuracy"] = training["seconds_to_target"]
    if training.get("staleness"):
        metrics["staleness_mean"] = training["staleness"]["mean"]
        metrics["staleness_max"] = training["staleness"]["max"]
    # None where nothing was measured (a retry that had no epoch left to train).
    return {name: value for name, value in metrics.items() if value is not None}


def _export_metrics(exported: dict) -> dict[str, float]:
    """Per exported artifact: size raw and gzipped, test accuracy, agreement, latency."""
    metrics = {}
    for name, artifact in exported["artifacts"].items():
        for key in ("bytes", "gzip_bytes", "test_accuracy", "agreement_with_float", "latency_ms"):
            metrics[f"export_{name}_{key}"] = artifact[key]
    return metrics


def log_run_record(
    client: MlflowClient,
    run_id: str,
    spec: RunSpec,
    paths: RunPaths,
    dataset: dict,
    training: dict,
    evaluation: dict,
    exported: dict,
) -> None:
    """Tags, params, curves, final metrics and artifacts of the run; safe to repeat on retry."""
    tags = {
        "dataset.name": dataset["name"],
        "dataset.version": dataset["version"],
        "dataset.fingerprint": dataset["fingerprint"],
        "dataset.source": dataset["source_path"],
        "mlflow.source.git.commit": _git_commit(),
        "strategy": spec.strategy,
    }
    params = {
        **spec.model_dump(),
        "effective_steps_per_epoch": training["steps_per_epoch"],
        "replicas_in_sync": training["replicas_in_sync"],
        "per_replica_batch": training["per_replica_batch"],
    }
    summary = {**_summary_metrics(training, evaluation), **_export_metrics(exported)}
    if paths.restarts.exists():  # restart_policy restarted replicas
        restarts = json.loads(paths.restarts.read_text())
        summary["restarts"] = len(restarts)
        tags["restarts"] = "; ".join(
            f"{r['replica']} exited {r['exit_code']} ({r['cause']}): {r['action']}" for r in restarts
        )[:5000]
    if paths.plan.exists():  # the workers were probed (strategy=auto, or balance_batches by the workers)
        plan = json.loads(paths.plan.read_text())
        params["requested_strategy"] = plan["requested"]["strategy"]
        for probe in plan["probes"]:
            summary[f"probe_{probe['worker'].replace('-', '_')}_examples_per_second"] = probe["examples_per_second"]
        if "decision" in plan:
            tags["auto.decision"] = plan["decision"]["reason"]
        if "worker_batches" in plan:
            params["worker_batches"] = plan["worker_batches"]
    now = get_current_time_millis()
    metrics = [Metric(key, value, now, 0) for key, value in summary.items()]
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
    for path in (paths.spec, paths.dataset, paths.training, paths.evaluation, paths.compression, paths.export):
        client.log_artifact(run_id, str(path), "run")
    for path in (paths.plan, paths.restarts):
        if path.exists():
            client.log_artifact(run_id, str(path), "run")
    client.log_artifacts(run_id, str(paths.logs), "logs")
    client.log_artifacts(run_id, str(paths.plots), "plots")
    lineage.log_dataset(client, run_id, dataset)
    events = lineage.write_tensorboard_events(training, paths.root / "tensorboard")
    client.log_artifacts(run_id, str(events), "tensorboard")


def own_registered_model(client: MlflowClient, name: str, registered_model: str) -> None:
    """Create registered model ``name`` marked as hetflow's, or check that the one there is hetflow's.

    In a shared registry the name may already hold someone else's model: registering into it, and
    comparing against its champion, would mix hetflow's versions with theirs. ``registered_model``
    is the spec's value that chose the name (the TFLite model's name adds ``-tflite`` to it)."""
    try:
        client.create_registered_model(name, tags={OWNER_TAG: OWNER})
        return
    except MlflowException as error:
        # Created meanwhile, by an earlier run or a concurrent one (the tag comes with the creation).
        if error.error_code not in (ErrorCode.Name(RESOURCE_ALREADY_EXISTS), ErrorCode.Name(ALREADY_EXISTS)):
            raise
    if client.get_registered_model(name).tags.get(OWNER_TAG) != OWNER:
        raise ForeignRegisteredModel(
            f"registered_model {registered_model!r}: the registered model {name!r} in {tracking_uri()} was not "
            f"created by hetflow (no tag {OWNER_TAG}={OWNER}); choose another registered_model"
        )


@contextmanager
def promotion_lock(name: str):
    """Hold the one promotion of registered model ``name`` in this MLflow store: an exclusive lock
    on a file under $HETFLOW_HOME, which every process of a deployment shares (the kernel releases
    it when its holder dies, so a killed task leaves no stale lock)."""
    key = hashlib.sha256(f"{tracking_uri()}\n{name}".encode()).hexdigest()[:16]
    path = hetflow_home() / "locks" / f"promote-{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # closing the file releases it
        yield


def _version_by_alias(client: MlflowClient, name: str, alias: str):
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def _register(client: MlflowClient, name: str, run_id: str, log_model: Callable[[], Any]):
    """Log and register a model version, or return the one a previous try of this run made."""
    existing = client.search_model_versions(f"name='{name}' and run_id='{run_id}'")
    if existing:
        log.info("run %s already registered %s version %s: re-using it", run_id, name, existing[0].version)
        return existing[0]
    with timings.part("mlflow_io"), mlflow.start_run(run_id=run_id):
        info = log_model()
    return client.get_model_version(name, str(info.registered_model_version))


def _log_saved_model(saved_model: Path, name: str, images: np.ndarray, predict: Callable[[np.ndarray], np.ndarray]):
    """Log the exported SavedModel through MLflow's TensorFlow flavour as a plain ``tf.Module``:
    MLflow then loads it with ``tf.saved_model.load``, without Keras, so it loads in any process
    with TensorFlow whatever its Keras (a tf_keras model would need TF_USE_LEGACY_KERAS=1).

    :param predict: the exported model's logits (``export.saved_model_predictor``), for the signature.
    """
    import tensorflow as tf

    exported = tf.saved_model.load(str(saved_model))
    serve = exported.signatures["serving_default"]

    class Logits(tf.Module):
        """MLflow's pyfunc calls the module: ``__call__`` is serving_default's logits."""

        def __init__(self):
            super().__init__()
            self.exported = exported  # tracked, so its variables are saved
            self.__call__ = tf.function(
                lambda image: serve(image=image)["logits"],
                input_signature=[serve.structured_input_signature[1]["image"]],
            )

    example = images[:5]
    return mlflow.tensorflow.log_model(
        Logits(),
        name="model",
        # TF Serving and tf.saved_model.load users keep the export's signature (uint8 image -> logits).
        saved_model_kwargs={"signatures": {"serving_default": serve}},
        signature=infer_signature(example, predict(example)),
        input_example=example,
        registered_model_name=name,
        pip_requirements=[f"tensorflow=={version('tensorflow')}", f"numpy=={np.__version__}"],
    )


def _log_tflite_model(tflite_path: str, name: str, images: np.ndarray, predict: Callable[[np.ndarray], np.ndarray]):
    example = images[:5]
    return mlflow.pyfunc.log_model(
        name="tflite_model",
        python_model=str(Path(__file__).with_name("tflite_pyfunc.py")),
        artifacts={"tflite": tflite_path},
        signature=infer_signature(example, predict(example)),
        input_example=example,
        registered_model_name=name,
        pip_requirements=[f"ai-edge-litert=={version('ai-edge-litert')}", f"numpy=={np.__version__}"],
    )


def champion_accuracy(champion, dataset: dict, log_dir: Path) -> float:
    """The champion's test accuracy on *this* run's test split.

    Its recorded accuracy counts when it was measured on the same prepared data (same dataset
    fingerprint); otherwise the champion is served and scored on this test split over HTTP: it
    is never loaded in this process, where a registered model's code would run. Raises
    ``serving.ServingError`` when it cannot be served.
    """
    if champion.tags.get("dataset.fingerprint") == dataset["fingerprint"]:
        return float(champion.tags["test_accuracy"])
    from tasks.data.pipeline import split_arrays

    images, labels = split_arrays(dataset, "test")
    uri = f"models:/{champion.name}/{champion.version}"
    with serving.ModelServer(
        uri, tracking_uri(), log_dir / f"{champion.name}-v{champion.version}-champion.log"
    ) as server:
        logits = server.predict(images)
    return float(np.mean(np.argmax(logits, axis=1) == labels))


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


def compression_table(exported: dict) -> str:
    """export.json as a markdown table: what a reviewer compares in the MLflow UI."""
    rows = [
        "| artifact | bytes | gzipped | test accuracy | agreement with float | latency ms (batch 1) | verdict |",
        "|---|--:|--:|--:|--:|--:|---|",
    ]
    for name, artifact in exported["artifacts"].items():
        verdict = "deployed" if name == exported["chosen_tflite"] else "accepted"
        if not artifact["accepted"]:
            verdict = f"rejected: {artifact['reason']}"
        rows.append(
            f"| {name} | {artifact['bytes']} | {artifact['gzip_bytes']} | {artifact['test_accuracy']:.4f} | "
            f"{artifact['agreement_with_float']:.4f} | {artifact['latency_ms']:.4f} | {verdict} |"
        )
    return "\n".join(rows)


def _start_served_check(
    pool: ThreadPoolExecutor,
    client: MlflowClient,
    version,
    predict: Callable[[np.ndarray], np.ndarray],
    images: np.ndarray,
    log_dir: Path,
) -> Future | None:
    """Start the served check of a version in ``pool``, comparing with ``predict``'s logits; None when a
    previous try of the task decided the version's gate (it is not served again)."""
    if _decided(client, version) is not None:
        return None
    batch = images[: serving.CHECK_EXAMPLES]
    log_path = log_dir / f"{version.name}-v{version.version}.log"
    uri = f"models:/{version.name}/{version.version}"
    return pool.submit(serving.served_check, uri, tracking_uri(), batch, predict(batch), log_path)


def _decided(client: MlflowClient, version) -> str | None:
    """The gate's decision on ``version`` when a previous try of the task applied it, else None."""
    recorded = client.get_model_version(version.name, version.version).tags
    champion = _version_by_alias(client, version.name, CHAMPION)
    if "gate" not in recorded and champion is not None and champion.version == version.version:
        return "already champion (task retried)"
    return recorded.get("gate")


def _promote(
    client: MlflowClient,
    spec: RunSpec,
    version,
    accuracy: float,
    dataset: dict,
    tags: dict[str, str],
    check: Future | None,
    report: str,
    table: str,
    log_dir: Path,
) -> dict[str, Any]:
    """Tag the version and give it ``candidate``; give it ``champion`` when it passes the served
    check (``check``, running: None when ``_decided`` found the gate already applied) and the
    accuracy gate; describe it."""
    name = version.name
    for key, value in {**tags, "test_accuracy": repr(accuracy)}.items():
        client.set_model_version_tag(name, version.version, key, value)
    client.set_registered_model_alias(name, CANDIDATE, version.version)
    champion = _version_by_alias(client, name, CHAMPION)
    is_champion = champion is not None and champion.version == version.version
    # A retried task finds the gate already applied to this version: its decision stands.
    decided = _decided(client, version)
    if decided is not None:
        decision = {"promote": is_champion, "reason": decided}
        recorded = client.get_model_version(name, version.version).tags
        served = json.loads(recorded["served"]) if "served" in recorded else None
    else:
        served = check.result()  # the candidate's own check, independent of the champion: outside the lock
        with promotion_lock(name):
            # Read again under the lock: another run may have moved `champion` since the read above,
            # and none can move it between this read and our set.
            champion = _version_by_alias(client, name, CHAMPION)
            versus, score, unscored = "no champion yet", None, None
            if champion is not None:
                try:
                    score = champion_accuracy(champion, dataset, log_dir)
                    versus = f"champion v{champion.version} {score:.4f} (margin {accuracy - score:+.4f})"
                except (serving.ServingError, OSError) as error:
                    unscored = (
                        f"champion v{champion.version} could not be served to score it on this test split: {error}"
                    )
                    versus = unscored
            if not served["passed"]:
                decision = {"promote": False, "reason": f"served check failed: {served['reason']}"}
            elif unscored is not None:  # a champion that no server can run is no champion to defend
                decision = {"promote": True, "reason": unscored}
            else:
                decision = gate(spec, accuracy, champion, score)
            if decision["promote"]:
                client.set_registered_model_alias(name, CHAMPION, version.version)
            # The decision is recorded under the lock too: a retry of this task must find it.
            client.set_model_version_tag(name, version.version, "served", json.dumps(served))
            client.set_model_version_tag(name, version.version, "gate", decision["reason"][:5000])
        client.update_model_version(
            name,
            version.version,
            description=(
                f"{report}\n- test accuracy: {accuracy:.4f} vs {versus}\n"
                f"- served check: {serving.describe(served)}\n- gate: {decision['reason']}\n\n"
                f"Compression (export.json):\n\n{table}"
            ),
        )
    log.info("%s gate: %s -> %s", name, decision["reason"], "champion" if decision["promote"] else "stays candidate")
    return {
        "model_name": name,
        "version": int(version.version),
        "model_uri": f"models:/{name}/{version.version}",
        "aliases": sorted(client.get_model_version(name, version.version).aliases),
        "promoted": decision["promote"],
        "gate": decision["reason"],
        "served": served,
    }


def register(spec: RunSpec, paths: RunPaths, dataset: dict, dag_id: str, airflow_run_id: str) -> dict[str, Any]:
    """Record the run in MLflow, register the float model and the chosen TFLite variant, serve each
    (infra validation), move the aliases; writes registry.json."""
    from tasks.data.pipeline import split_arrays
    from tasks.export import save_serving_model, saved_model_predictor, tflite_predictor

    training = json.loads(paths.training.read_text())
    evaluation = json.loads(paths.evaluation.read_text())
    exported = json.loads(paths.export.read_text())
    compression = json.loads(paths.compression.read_text())
    mlflow.set_tracking_uri(tracking_uri())
    client = timings.TimedClient(MlflowClient())
    name, chosen = spec.registered_model, exported["chosen_tflite"]
    tflite_name = f"{name}-tflite"
    # Refused before anything is written to MLflow.
    for model_name in [name, tflite_name] if chosen is not None else [name]:
        own_registered_model(client, model_name, name)
    run_id = find_or_create_run(client, dag_id, airflow_run_id, run_name=paths.root.name)
    images, _ = split_arrays(dataset, "test")
    log_dir = paths.root / "serving"
    tags = {
        "airflow.run_id": airflow_run_id,
        "dataset.name": dataset["name"],
        "dataset.version": dataset["version"],
        "dataset.fingerprint": dataset["fingerprint"],
        lineage.TRAINING_KEY_TAG: dataset["training_key"],
        "strategy": spec.strategy,
        "model": spec.model,
    }
    headline = (
        f"Trained by Airflow run `{airflow_run_id}` ({spec.strategy}, {spec.model}) on "
        f"{dataset['name']} {dataset['version']}.\n\n"
        f"- dataset: {dataset['name']} {dataset['version']}, fingerprint `{dataset['fingerprint']}`, "
        f"from `{dataset['source_path']}`\n"
    )
    table = compression_table(exported)

    if not paths.saved_model.exists():  # export_formats without saved_model: the registry still serves one
        from tasks.models import trained_model

        save_serving_model(trained_model(spec, dataset, paths.model), paths.saved_model)
    # Each served check starts as soon as its version exists. A model server is CPU-bound while it
    # starts (measured alone here: the TFLite model's ~8 s, the float model's ~13 s, most of it
    # importing TensorFlow): the TFLite model is registered first, so that its server's start-up
    # overlaps this thread's logging of the float model rather than the float model's server, the
    # longest, which then shares the two cores with one other process at most.
    with ThreadPoolExecutor(max_workers=2) as pool:
        # (version, its served check running, test accuracy, tags, description's report)
        candidates = []
        if chosen is not None:
            artifact = exported["artifacts"][chosen]
            tflite_predict = tflite_predictor(Path(artifact["path"]))
            tflite_version = _register(
                client,
                tflite_name,
                run_id,
                lambda: _log_tflite_model(artifact["path"], tflite_name, images, tflite_predict),
            )
            tflite_check = _start_served_check(pool, client, tflite_version, tflite_predict, images, log_dir)
            compression_tags = {
                "variant": artifact["variant"],
                "prune": str(spec.prune),
                "target_sparsity": str(compression.get("target_sparsity", 0.0)),
                "quantize": artifact["quantize"],
                "size_bytes": str(artifact["bytes"]),
                "size_gzip_bytes": str(artifact["gzip_bytes"]),
            }
            report = headline + (
                f"- TFLite variant `{artifact['variant']}`: {artifact['bytes']} bytes, {artifact['gzip_bytes']} "
                f"gzipped, float model's accuracy {exported['float_test_accuracy']:.4f}, agreement with it "
                f"{artifact['agreement_with_float']:.4f}, latency at batch 1 {artifact['latency_ms']:.4f} ms"
            )
            candidates.append(
                (tflite_version, tflite_check, artifact["test_accuracy"], {**tags, **compression_tags}, report)
            )
        float_predict = saved_model_predictor(paths.saved_model)
        version = _register(
            client, name, run_id, lambda: _log_saved_model(paths.saved_model, name, images, float_predict)
        )
        float_check = _start_served_check(pool, client, version, float_predict, images, log_dir)
        report = headline + "- float model: the exported SavedModel (serving_default: raw uint8 images -> logits)"
        candidates.insert(0, (version, float_check, evaluation["test_accuracy"], tags, report))
        log_run_record(client, run_id, spec, paths, dataset, training, evaluation, exported)
        models = [
            _promote(client, spec, v, accuracy, dataset, v_tags, check, v_report, table, log_dir)
            for v, check, accuracy, v_tags, v_report in candidates
        ]
    _log_served_checks(client, run_id, models, log_dir)
    client.set_tag(run_id, "registry.gate", models[0]["gate"])
    record = {
        **models[0],
        "models": models,
        "mlflow_run_id": run_id,
        "mlflow_tracking_uri": tracking_uri(),
    }
    write_record(paths.registry, record)
    return record


def _log_served_checks(client: MlflowClient, run_id: str, models: list[dict], log_dir: Path) -> None:
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
        client.log_artifacts(run_id, str(log_dir), "serving")

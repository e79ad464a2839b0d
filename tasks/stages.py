"""The stages of ``hetflow_train``: plain functions of the Airflow run id, no Airflow import.

Each stage reads what earlier stages wrote in the run directory and writes its own record there, so
any stage can be re-run (an Airflow retry, a Clear) or run outside Airflow (``hetflow train``, tests).
Each attempt of a stage first removes its own record and every later stage's, and when it succeeds
leaves a receipt naming itself (``attempts/<stage>.json``): ``summarize`` trusts a record only with
the receipt of the attempt Airflow reports as the stage's last, successful try.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from tasks import timings
from tasks.paths import RunPaths, create_run_dir, data_dir, run_paths, write_record
from tasks.spec import RunSpec, SpecError, parse_spec

log = logging.getLogger("hetflow.stages")

# (stage, the record it writes), in DAG order; the stages' names are their Airflow task ids.
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
STAGES = tuple(stage for stage, _ in STAGE_OUTPUTS)


def _reported(stage: Callable) -> Callable:
    """Time a stage (``tasks.timings``: its receipt records where its time went) and log its failure,
    with its reason, on the stages' logger: Airflow reports it in its own structured log, which
    `hetflow run`'s live view does not read."""

    @functools.wraps(stage)
    def run(*args, **kwargs):
        with timings.stage_clock():
            try:
                return stage(*args, **kwargs)
            except Exception as error:
                log.error(
                    "%s failed: %s: %s",
                    stage.__name__,
                    type(error).__name__,
                    str(error).splitlines()[0] if str(error) else "",
                )
                raise

    return run


def _read(path) -> Any:
    return json.loads(path.read_text())


def load_spec(paths: RunPaths) -> RunSpec:
    return RunSpec.model_validate_json(paths.spec.read_text())


@contextlib.contextmanager
def _attempt(paths: RunPaths, stage: str, run_id: str, try_number: int | None):
    """One attempt of ``stage``: on entry it removes the records of this stage and of every later one,
    and the summary, so that no earlier attempt's files outlive a failing one; on success it writes
    the receipt naming this attempt (the dict it yields, which the stage also returns to Airflow) and
    saying where the stage's time went (``timing``: its start, unix time, and ``tasks.timings``'
    parts in seconds, up to the receipt).

    :param try_number: Airflow's try number of the task (None outside Airflow), for the reader.
    """
    for later, record in STAGE_OUTPUTS[STAGES.index(stage) :]:
        paths.attempt(later).unlink(missing_ok=True)  # the receipt first: a record without one is not trusted
        getattr(paths, record).unlink(missing_ok=True)
    paths.summary.unlink(missing_ok=True)
    attempt = {"stage": stage, "run_id": run_id, "try_number": try_number, "id": uuid.uuid4().hex}
    yield attempt
    clock = timings.current()
    timing = {"started_at": clock.started_at, **clock.record()} if clock else None
    write_record(
        paths.attempt(stage), {**attempt, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "timing": timing}
    )


@_reported
def validate_spec(values: dict[str, Any], run_id: str, try_number: int | None = None) -> dict[str, Any]:
    """Validate the run's conf (form values plus any extra keys); nothing starts when it is invalid."""
    from tasks.cluster import backends

    spec = parse_spec(values)
    problems = backends.preflight(spec, run_id) + data_problems(spec)
    if problems:
        # Before any record is touched: a refused run id may belong to a run that is still going.
        raise SpecError(problems)
    paths = create_run_dir(run_id)
    with _attempt(paths, "validate_spec", run_id, try_number) as attempt:
        write_record(paths.spec, spec.model_dump(mode="json"))
    log.info("spec: %s", spec.model_dump())
    return {**spec.model_dump(), "attempt": attempt}


def data_problems(spec: RunSpec) -> list[str]:
    """What keeps the spec's dataset from being prepared here (bad images, an unknown name, no
    network for a download), as one line; checked before anything starts."""
    from tasks.data.prepare import check_available

    try:
        check_available(spec.dataset, dataset_dir(spec), spec.image_size)
    except ValueError as error:
        return [str(error)]
    return []


def dataset_dir(spec: RunSpec) -> Path:
    """Where the run's TFDS datasets and image folders are prepared."""
    return Path(spec.data_dir) if spec.data_dir else data_dir()


@_reported
def prepare_data(run_id: str, try_number: int | None = None) -> dict[str, Any]:
    """Prepare the dataset (or re-use it) and say whether this training was done before: with
    skip_unchanged, a version trained by another run from the same spec on the same data makes the
    rest of the run skip (``record["trained_before"]``)."""
    from tasks.data.prepare import prepare_dataset
    from tasks.lineage import training_key

    paths = run_paths(run_id)
    with _attempt(paths, "prepare_data", run_id, try_number) as attempt:
        spec = load_spec(paths)
        record = prepare_dataset(spec.dataset, dataset_dir(spec), spec.image_size)
        record["training_key"] = training_key(spec, record["fingerprint"])
        record["trained_before"] = _trained_before(spec, record["training_key"], run_id)
        write_record(paths.dataset, record)
    log.info(
        "dataset %s %s %s (fingerprint %s)",
        record["name"],
        record["version"],
        "re-used" if record["reused"] else "prepared",
        record["fingerprint"][:12],
    )
    if record["trained_before"]:
        log.info("unchanged: %s", skip_reason(record))
    return {**record, "attempt": attempt}


def _trained_before(spec: RunSpec, key: str, run_id: str) -> dict[str, Any] | None:
    if not spec.skip_unchanged:
        return None
    from mlflow import MlflowClient
    from tasks.lineage import trained_before
    from tasks.registry import tracking_uri

    try:
        with timings.part("mlflow_io"):
            return trained_before(MlflowClient(tracking_uri()), spec.registered_model, key, run_id)
    except Exception as error:  # noqa: BLE001  (an unreachable server, two runs creating one SQLite store, ...)
        # Training is never skipped on a guess; register will say if MLflow is still away.
        log.warning("could not ask MLflow whether this training was done before (%s): training", error)
        return None


def skip_reason(dataset: dict[str, Any]) -> str:
    before = dataset["trained_before"]
    return (
        f"{before['model_name']} v{before['version']} was trained from this spec on data with fingerprint "
        f"{dataset['fingerprint'][:12]} by Airflow run {before['airflow_run_id']}: nothing to train or register "
        "(skip_unchanged=false trains again)"
    )


# Runs whose replicas this process started and has not torn down: what `hetflow run` ends when
# interrupted (Ctrl-C), as its DAG's teardown task would not run.
PROVISIONED_HERE: set[str] = set()


@_reported
def provision_cluster(run_id: str, try_number: int | None = None) -> dict[str, Any]:
    """Lay out the cluster and start every replica (processes, containers or pods); ``train``
    supervises them."""
    from tasks.cluster import backends

    paths = run_paths(run_id)
    with _attempt(paths, "provision_cluster", run_id, try_number) as attempt:
        spec = load_spec(paths)
        if spec.strategy == "auto":  # balance_batches alone: the workers probe themselves when they start
            from tasks.auto import plan_training

            spec = plan_training(spec, run_id, paths)
            # From here on the run trains with the resolved spec; the request stays in plan.json.
            write_record(paths.spec, spec.model_dump(mode="json"))
        paths.restarts.unlink(missing_ok=True)  # a re-provisioned run starts its restart count anew
        layout = backends.plan(spec, run_id)
        write_record(paths.cluster, layout.to_dict())
        cluster = backends.replicas(spec, layout, paths.root)
        PROVISIONED_HERE.add(run_id)
        cluster.provision()
    log.info(
        "started %s on %s: %s", ", ".join(r.name for r in cluster.layout.replicas), spec.backend, layout.cluster_spec()
    )
    return {**cluster.layout.to_dict(), "attempt": attempt}


@_reported
def train(run_id: str, try_number: int | None = None) -> dict[str, Any]:
    """Supervise the provisioned replicas until training ends; their output streams into this
    task's log. A SIGTERM (Airflow stopping the task) stops them before the task goes. With
    ``IMPORT_LATER_STAGES`` set, the later stages' modules are imported meanwhile."""
    from tasks.cluster import backends
    from tasks.cluster.layout import ClusterLayout

    paths = run_paths(run_id)
    with _attempt(paths, "train", run_id, try_number) as attempt:
        spec = load_spec(paths)
        cluster = backends.replicas(spec, ClusterLayout.from_dict(_read(paths.cluster)), paths.root)
        importing = _import_in_background(LATER_STAGE_MODULES) if IMPORT_LATER_STAGES else None
        with _stopped_on_sigterm(lambda: backends.teardown(spec, run_id, grace=SIGTERM_STOP_GRACE_SECONDS)):
            backends.supervise(spec, cluster, paths.root, spec.train_timeout_seconds)
        if importing is not None:
            importing.join()  # no later stage imports a module while that thread still does
    return {**_read(paths.training), "attempt": attempt}


# What the stages after training import (TensorFlow, tf_keras, tensorflow-model-optimization, matplotlib,
# LiteRT, MLflow's TensorFlow flavour: ~7 s here). Where every task runs in one process (`hetflow run`'s
# dag.test sets IMPORT_LATER_STAGES), train imports them while it only waits for the replicas, off the
# critical path; where each task has a process of its own (a scheduler), that would be wasted.
LATER_STAGE_MODULES = ("tasks.evaluate", "tasks.compress", "tasks.export", "tasks.registry", "mlflow.tensorflow")
IMPORT_LATER_STAGES = False


def _import_in_background(modules: tuple[str, ...]) -> threading.Thread:
    def run():
        started = time.perf_counter()
        try:
            for module in modules:
                importlib.import_module(module)
        except Exception as error:  # noqa: BLE001  (the stage that needs the module imports it again and says why)
            log.warning("importing the later stages' modules during training failed: %s", error)
            return
        log.info(
            "imported the later stages' modules in %.1f s while the replicas trained", time.perf_counter() - started
        )

    thread = threading.Thread(target=run, name="import-later-stages", daemon=True)
    thread.start()
    return thread


class Interrupted(RuntimeError):
    pass


# Airflow 3 SIGKILLs a task 5 s after its SIGTERM: the replicas get 2 s to stop before SIGKILL, so
# the teardown (the network namespace's deletion included) is over before the task is killed.
SIGTERM_STOP_GRACE_SECONDS = 2.0


@contextlib.contextmanager
def _stopped_on_sigterm(stop):
    """Run ``stop`` when SIGTERM arrives: Airflow 3 stops a task with SIGTERM and kills it a few
    seconds later, so a ``finally`` that waits for replicas would never run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum, frame):
        log.warning("SIGTERM: stopping the replicas")
        stop()
        raise Interrupted("stopped by SIGTERM; the replicas were stopped")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@_reported
def teardown_cluster(run_id: str) -> list:
    """End what is left of the run's replicas: pids (local), containers (docker), pods (kubernetes)."""
    from tasks.cluster import backends
    from tasks.cluster.sweep import sweep
    from tasks.paths import hetflow_home

    paths = run_paths(run_id)
    ended = backends.teardown(load_spec(paths) if paths.spec.exists() else None, run_id)
    PROVISIONED_HERE.discard(run_id)
    log.info("teardown: %s", f"ended {ended}" if ended else "no replica was left running")
    try:  # what earlier runs left when they were killed before their own teardown
        swept = sweep(hetflow_home())
    except Exception:  # another run's leftovers must not fail this run's teardown
        log.exception("sweeping what interrupted runs left failed")
    else:
        if any(swept.values()):
            log.info("teardown also swept what interrupted runs left: %s", swept)
    return ended


@_reported
def evaluate(run_id: str, try_number: int | None = None) -> dict[str, Any]:
    from tasks.evaluate import evaluate as evaluate_model

    paths = run_paths(run_id)
    with _attempt(paths, "evaluate", run_id, try_number) as attempt:
        result = evaluate_model(paths, _read(paths.dataset))
    log.info("test accuracy %.4f, loss %.4f", result["test_accuracy"], result["test_loss"])
    return {**{k: v for k, v in result.items() if k != "confusion_matrix"}, "attempt": attempt}


@_reported
def compress(run_id: str, try_number: int | None = None) -> dict[str, Any]:
    from tasks.compress import compress as compress_model

    paths = run_paths(run_id)
    with _attempt(paths, "compress", run_id, try_number) as attempt:
        record = compress_model(load_spec(paths), paths, _read(paths.dataset))
    log.info("compressed variants: %s; kernel sparsity %s", list(record["variants"]), record.get("kernel_sparsity"))
    return {**record, "attempt": attempt}


@_reported
def export(run_id: str, try_number: int | None = None) -> dict[str, Any]:
    from tasks.export import export as export_artifacts

    paths = run_paths(run_id)
    with _attempt(paths, "export", run_id, try_number) as attempt:
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
    return {
        "chosen_tflite": record["chosen_tflite"],
        "float_test_accuracy": record["float_test_accuracy"],
        "attempt": attempt,
    }


class TrackingUnavailable(RuntimeError):
    pass


@_reported
def register(run_id: str, dag_id: str, try_number: int | None = None) -> dict[str, Any]:
    """Everything to MLflow. MLflow's client retries with backoff (MLFLOW_HTTP_REQUEST_MAX_RETRIES,
    MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR); when the server stays away the task fails saying so, and
    the run's files stay in place for a retry of this task."""
    import requests
    from mlflow.exceptions import MlflowException

    from tasks.registry import register as register_model
    from tasks.registry import tracking_uri

    paths = run_paths(run_id)
    try:
        with _attempt(paths, "register", run_id, try_number) as attempt:
            record = register_model(load_spec(paths), paths, _read(paths.dataset), dag_id, run_id)
    except (MlflowException, requests.exceptions.RequestException) as error:
        reason = str(error).splitlines()[0][:300]
        raise TrackingUnavailable(
            f"MLflow at {tracking_uri()} failed: {reason}; the trained model and every stage's files are kept "
            f"in {paths.root}: retry the register task once MLflow is reachable"
        ) from error
    return {**record, "attempt": attempt}


def _done(paths: RunPaths, stage: str, record: str, returned: dict[str, Any] | None) -> bool:
    """Whether ``stage``'s record is there with the receipt of the attempt that wrote it and, under
    Airflow, that attempt is the one whose return value Airflow holds (a stage's last try)."""
    receipt = paths.attempt(stage)
    if not (receipt.exists() and getattr(paths, record).exists()):
        return False
    if returned is None:  # outside Airflow: the receipt alone says the last attempt finished
        return True
    reported = (returned.get(stage) or {}).get("attempt") or {}
    return reported.get("id") == _read(receipt)["id"]


def _auto_decision(paths: RunPaths) -> dict[str, Any] | None:
    plan = _read(paths.plan) if paths.plan.exists() else {}
    if "decision" not in plan:
        return None
    return {
        "requested": plan["requested"]["strategy"],
        "decision": plan["decision"],
        "probes": plan["probes"],
    }


def _timings(paths: RunPaths, finished: tuple[str, ...], training: dict, dag_started_at: float | None) -> dict | None:
    """Where the run's time went so far: the DAG's wall time (from the DAG run's start, else the first
    stage's), the training's (the replicas' whole job: launch to final weights), the fixed overhead
    (DAG wall time less training), each finished stage's parts (``tasks.timings``) and Airflow's time
    outside every stage (task start-up and bookkeeping, teardown_cluster), of which before the first."""
    stages = {stage: _read(paths.attempt(stage)).get("timing") for stage in finished}
    stages = {stage: timing for stage, timing in stages.items() if timing}  # receipts of older hetflows have none
    if not stages:
        return None
    first_stage = min(timing["started_at"] for timing in stages.values())
    started = first_stage if dag_started_at is None else dag_started_at
    dag_seconds = time.time() - started
    training_seconds = training.get("whole_job_seconds")
    in_stages = sum(timing["wall"] for timing in stages.values())
    return {
        "dag_seconds": dag_seconds,
        "training_seconds": training_seconds,
        "fixed_overhead_seconds": None if training_seconds is None else dag_seconds - training_seconds,
        "airflow_seconds": dag_seconds - in_stages,
        "airflow_before_first_stage_seconds": first_stage - started,
        "stages": {
            stage: {part: timing[part] for part in ("wall", *timings.PARTS)} for stage, timing in stages.items()
        },
    }


@_reported
def summarize(
    run_id: str, returned: dict[str, Any] | None = None, dag_started_at: float | None = None
) -> dict[str, Any]:
    """Write summary.json; status is ``failed`` when a stage did not finish, whatever files an
    earlier attempt left behind.

    :param returned: each stage's return value as Airflow holds it for this DAG run, None where
        the stage's last try failed or never ran (Airflow deletes a task's XComs when a try
        starts); None outside Airflow, where the receipts alone decide.
    :param dag_started_at: when the DAG run started (unix time), for its wall time in ``timings``;
        None: from the first stage's start.
    """
    paths = run_paths(run_id)
    failed_stage = next((stage for stage, record in STAGE_OUTPUTS if not _done(paths, stage, record, returned)), None)
    # Only the records of the stages before the failed one are this attempt's: nothing after it is reported.
    finished = STAGES[: STAGES.index(failed_stage)] if failed_stage else STAGES
    unchanged = None
    if failed_stage == "provision_cluster" and _read(paths.dataset).get("trained_before"):
        unchanged = _read(paths.dataset)  # prepare_data found this training done before: the rest skipped
        failed_stage = None
    read = {stage: _read(getattr(paths, record)) if stage in finished else None for stage, record in STAGE_OUTPUTS}
    training, evaluation, registry = read["train"] or {}, read["evaluate"] or {}, read["register"] or {}
    exported = (read["export"] or {}).get("artifacts", {})
    dataset = read["prepare_data"] or {}
    summary = {
        "run_id": run_id,
        "status": "failed" if failed_stage else "skipped" if unchanged else "success",
        "failed_stage": failed_stage,
        "skipped_because": skip_reason(unchanged) if unchanged else None,
        "run_dir": str(paths.root),
        "attempts": {stage: _read(paths.attempt(stage)) for stage in finished},
        "spec": read["validate_spec"],
        "dataset": {k: dataset.get(k) for k in ("name", "version", "fingerprint", "splits", "source_path")},
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
            "model": {"path": str(paths.model), "bytes": paths.model.stat().st_size}
            if training and paths.model.exists()
            else None,
            "exported": {
                name: {k: a[k] for k in ("path", "bytes", "gzip_bytes", "test_accuracy", "accepted")}
                for name, a in exported.items()
            },
            "chosen_tflite": (read["export"] or {}).get("chosen_tflite"),
            "replica_logs": sorted(str(p) for p in paths.logs.glob("*.log")),
            "plots": sorted(str(p) for p in paths.plots.glob("*.png")),
        },
        "replicas": (read["provision_cluster"] or {}).get("replicas"),
        "restarts": _read(paths.restarts) if paths.restarts.exists() else [],
        "timings": _timings(paths, finished, training, dag_started_at),
        # strategy=auto: what it chose and why, from the probes (plan.json).
        "auto": _auto_decision(paths) if "provision_cluster" in finished else None,
        "registry": {
            k: registry.get(k) for k in ("model_name", "version", "model_uri", "aliases", "promoted", "gate", "models")
        }
        if registry
        else unchanged["trained_before"]
        if unchanged
        else None,
    }
    write_record(paths.summary, summary)
    if failed_stage:
        raise RuntimeError(f"run {run_id} failed at stage {failed_stage}; summary: {paths.summary}")
    return summary

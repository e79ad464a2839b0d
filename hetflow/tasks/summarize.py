"""summarize: summary.json, the run's one report, written whatever happened (``status`` is
``failed`` when a stage did not finish, whatever files an earlier attempt left behind)."""

from __future__ import annotations

import logging
import time
from typing import Any

from hetflow.cluster.supervisor import read_restarts
from hetflow.models.stage_split import read_stage_split
from hetflow.paths import NotRegularFile, RunPaths, read_replica_record, run_paths, write_record
from hetflow.pipeline.attempts import STAGE_OUTPUTS, STAGES, load_spec, read_record, reported
from hetflow.pipeline.timing import PARTS
from hetflow.records import DatasetRecord, EvaluationRecord, ExportRecord
from hetflow.registry import live
from hetflow.replica.training_json import TrainingRecord, read_training

log = logging.getLogger("hetflow.stages")


def _done(paths: RunPaths, stage: str, record: str, returned: dict[str, Any] | None) -> bool:
    """Whether ``stage``'s record is there with the receipt of the attempt that wrote it and, under
    Airflow, that attempt is the one whose return value Airflow holds (a stage's last try)."""
    receipt = paths.attempt(stage)
    if not (receipt.exists() and getattr(paths, record).exists()):
        return False
    if returned is None:  # outside Airflow: the receipt alone says the last attempt finished
        return True
    reported = (returned.get(stage) or {}).get("attempt") or {}
    return reported.get("id") == read_record(receipt)["id"]


def _auto_decision(paths: RunPaths) -> dict[str, Any] | None:
    """strategy=auto: what it chose and why, decided again from the pipeline's request and the probes
    (plan.json, a replica's: a plan that is not what the chief writes is named, not reported)."""
    from hetflow.replica.balance import measured
    from hetflow.spec import RunSpec

    if not paths.requested_spec.exists():
        return None
    try:
        plan = measured(paths, RunSpec.from_json(paths.requested_spec.read_text()))
    except NotRegularFile as refused:
        log.warning("%s", refused)
        return None
    if plan is None:
        return None
    return {
        "requested": plan.requested.cluster.strategy,
        "decision": plan.decision.model_dump() if plan.decision is not None else None,
        "probes": [probe.model_dump() for probe in plan.probes],
    }


def _stage_split(paths: RunPaths, training: TrainingRecord | None) -> dict[str, Any] | None:
    """strategy=model_parallel: each stage's layers and predicted time, and on swarm its node."""
    if training is None or training.strategy != "model_parallel":
        return None
    split = read_stage_split(paths.plan, load_spec(paths), training)
    nodes = read_replica_record(paths.nodes) if paths.nodes.exists() else {}
    stages = [stage.model_copy(update={"node": nodes.get(stage.replica)}) for stage in split.stages]
    return split.model_copy(update={"stages": stages}).model_dump()


def _timings(
    paths: RunPaths, finished: tuple[str, ...], training: TrainingRecord | None, dag_started_at: float | None
) -> dict | None:
    """Where the run's time went so far: the DAG's wall time (from the DAG run's start, else the first
    stage's), the training's (the replicas' whole job: launch to final weights), the fixed overhead
    (DAG wall time less training), each finished stage's parts (``hetflow.pipeline.timing``) and Airflow's time
    outside every stage (task start-up and bookkeeping, teardown_cluster), of which before the first."""
    stages = {stage: read_record(paths.attempt(stage)).get("timing") for stage in finished}
    stages = {stage: timing for stage, timing in stages.items() if timing}  # receipts of older hetflows have none
    if not stages:
        return None
    first_stage = min(timing["started_at"] for timing in stages.values())
    started = first_stage if dag_started_at is None else dag_started_at
    dag_seconds = time.time() - started
    training_seconds = training.whole_job_seconds if training is not None else None
    in_stages = sum(timing["wall"] for timing in stages.values())
    return {
        "dag_seconds": dag_seconds,
        "training_seconds": training_seconds,
        "fixed_overhead_seconds": None if training_seconds is None else dag_seconds - training_seconds,
        "airflow_seconds": dag_seconds - in_stages,
        "airflow_before_first_stage_seconds": first_stage - started,
        "stages": {stage: {part: timing[part] for part in ("wall", *PARTS)} for stage, timing in stages.items()},
    }


@reported
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
    # Read as data: the records from training on are at the run directory's top, where replicas write.
    read = {
        stage: read_replica_record(getattr(paths, record)) if stage in finished else None
        for stage, record in STAGE_OUTPUTS
        if stage != "train"
    }
    dataset = DatasetRecord.model_validate(read["prepare_data"]) if read["prepare_data"] else None
    unchanged = None
    if failed_stage == "provision_cluster" and dataset.trained_before:
        unchanged = dataset  # prepare_data found this training done before: the rest skipped
        failed_stage = None
    read["train"] = read_training(paths.training, load_spec(paths), dataset) if "train" in finished else None
    training, registry = read["train"], read["register"] or {}
    evaluation = EvaluationRecord.model_validate(read["evaluate"]) if read["evaluate"] else None
    exported = ExportRecord.model_validate(read["export"]) if read["export"] else None
    summary = {
        "run_id": run_id,
        "status": "failed" if failed_stage else "skipped" if unchanged else "success",
        "failed_stage": failed_stage,
        "skipped_because": unchanged.skip_reason if unchanged else None,
        "run_dir": str(paths.root),
        "attempts": {stage: read_record(paths.attempt(stage)) for stage in finished},
        "spec": read["validate_spec"],
        "dataset": {k: getattr(dataset, k, None) for k in ("name", "version", "fingerprint", "splits", "source_path")},
        "mlflow_tracking_uri": registry.get("mlflow_tracking_uri"),
        "mlflow_run_id": registry.get("mlflow_run_id"),
        "mlflow_run_url": live.tracked_page(paths),
        "metrics": {
            "test_accuracy": getattr(evaluation, "test_accuracy", None),
            "test_loss": getattr(evaluation, "test_loss", None),
            "train_seconds": getattr(training, "train_seconds", None),
            "examples_per_second": getattr(training, "examples_per_second", None),
            "time_to_first_step_seconds": getattr(training, "time_to_first_step_seconds", None),
        },
        "artifacts": _artifacts(paths, trained=training is not None, exported=exported),
        "replicas": (read["provision_cluster"] or {}).get("replicas"),
        "restarts": read_restarts(paths),
        # backend=swarm: the node each replica ran on (train writes it)
        "nodes": read_replica_record(paths.nodes) if paths.nodes.exists() else None,
        "timings": _timings(paths, finished, training, dag_started_at),
        # strategy=auto: what it chose and why, from the probes (plan.json).
        "auto": _auto_decision(paths) if "provision_cluster" in finished else None,
        # strategy=model_parallel: each stage's layers and predicted time (plan.json), and its node on swarm
        "stage_split": _stage_split(paths, training),
        "registry": {
            k: registry.get(k) for k in ("model_name", "version", "model_uri", "aliases", "promoted", "gate", "models")
        }
        if registry
        else unchanged.trained_before.model_dump()
        if unchanged
        else None,
    }
    write_record(paths.summary, summary)
    log.info("%s", headline(summary))
    if summary["mlflow_run_url"]:
        log.info("MLflow: %s", summary["mlflow_run_url"])
    log.info("summary: %s", paths.summary)
    if failed_stage:
        raise RuntimeError(f"run {run_id} failed at stage {failed_stage}; summary: {paths.summary}")
    return summary


def _artifacts(paths: RunPaths, trained: bool, exported: ExportRecord | None) -> dict[str, Any]:
    """The run's files: the trained weights, the exported artifacts, replica logs and plots."""
    return {
        "model": {"path": str(paths.model), "bytes": paths.model.stat().st_size}
        if trained and paths.model.exists()
        else None,
        "exported": {
            name: {
                "path": a.path,
                "bytes": a.bytes,
                "gzip_bytes": a.gzip_bytes,
                "test_accuracy": a.test_accuracy,
                "accepted": a.accepted,
            }
            for name, a in (exported.artifacts if exported else {}).items()
        },
        "chosen_tflite": exported.chosen_tflite if exported else None,
        "replica_logs": sorted(str(p) for p in paths.logs.glob("*.log")),
        "plots": sorted(str(p) for p in paths.plots.glob("*.png")),
    }


def headline(summary: dict[str, Any]) -> str:
    """The run in one line for its task log: how it ended, its scores, what was registered."""
    if summary["status"] == "failed":
        return f"run {summary['run_id']} failed at stage {summary['failed_stage']}"
    if summary["status"] == "skipped":
        return f"run {summary['run_id']} skipped: {summary['skipped_because']}"
    metrics, registry = summary["metrics"], summary["registry"] or {}
    parts = [f"run {summary['run_id']} succeeded"]
    if metrics["test_accuracy"] is not None:
        parts.append(f"test accuracy {metrics['test_accuracy']:.4f}")
    if metrics["examples_per_second"] is not None:
        parts.append(f"{metrics['examples_per_second']:.0f} examples/s in training")
    if registry.get("version"):
        aliases = ", ".join(registry.get("aliases") or []) or "no alias"
        parts.append(f"registered {registry['model_name']} version {registry['version']} ({aliases})")
    return "; ".join(parts)

"""train: the provisioned replicas supervised until training ends; their output streams into this
task's log, each epoch the chief reports and each replica's CPU and memory go to the live MLflow run
(and to any other watcher: a tuning study's pruner, which may stop training early), and a SIGTERM
(Airflow stopping the task) stops them before the task goes."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from hetflow.models.stage_split import StageSplit, read_stage_split
from hetflow.paths import RunPaths, run_paths
from hetflow.pipeline.attempts import attempt, load_spec, read_record, reported
from hetflow.pipeline.interrupt import SIGTERM_STOP_GRACE_SECONDS, stopped_on_sigterm
from hetflow.pipeline.progress import ProgressReader, ProgressWatch, Watcher
from hetflow.records import DatasetRecord
from hetflow.replica.training_json import read_training
from hetflow.spec import RunSpec

log = logging.getLogger("hetflow.stages")


@reported
def train(
    run_id: str, try_number: int | None = None, watchers: Sequence[Watcher] = (), log_label: str = ""
) -> dict[str, Any]:
    """Supervise the provisioned replicas until training ends.

    :param watchers: besides the live MLflow run, what gets each new epoch and usage sample
        (``hetflow.pipeline.progress``); one that returns a reason stops training (StoppedEarly).
    :param log_label: names the run before each replica's output line in the log (a study's trial)."""
    from hetflow.cluster import supervisor
    from hetflow.cluster.backends.base import backend_for
    from hetflow.cluster.layout import ClusterLayout

    paths = run_paths(run_id)
    with attempt(paths, "train", run_id, try_number) as receipt:
        spec = load_spec(paths)
        backend = backend_for(spec)
        cluster = backend.replicas(spec, ClusterLayout.from_dict(read_record(paths.cluster)), paths.root)
        with (
            stopped_on_sigterm(lambda: backend.teardown(spec, run_id, grace=SIGTERM_STOP_GRACE_SECONDS)),
            _watch(paths, spec, cluster, watchers) as watch,
        ):
            timeout = spec.cluster.run_policy.timeout_seconds
            supervisor.supervise(spec, cluster, paths.root, timeout, lambda: watch.stop_reason, log_label)
    training = read_training(paths.training, spec, DatasetRecord.read(paths))
    if spec.cluster.strategy == "model_parallel":
        _log_stage_split(read_stage_split(paths.plan, spec, training))
    return {**training.model_dump(mode="json", exclude_unset=True), "attempt": receipt}


def _watch(paths: RunPaths, spec: RunSpec, cluster, watchers: Sequence[Watcher]) -> ProgressWatch:
    """The epochs the chief reports and the replicas' usage, for the live MLflow run (where the DAG
    run has one) and ``watchers``."""
    from hetflow.registry.live import live_run

    live = live_run(paths)
    everyone = [*watchers, *([live] if live is not None else [])]
    workers = [replica.name for replica in cluster.layout.replicas if replica.role == "worker"]
    sampler = getattr(cluster, "usage_sampler", None)  # local and docker replicas offer one
    sample = sampler() if everyone and sampler else None
    return ProgressWatch(ProgressReader(paths, spec, workers), sample, everyone)


def _log_stage_split(split: StageSplit) -> None:
    """model_parallel's layer groups and why: each stage's layers and predicted time, as the
    pipeline recomputed them from the chief's measurements."""
    for stage in split.stages:
        log.info(
            "stage on %s: %s (%.1f ms a micro-batch, predicted)",
            stage.device,
            ", ".join(stage.layers),
            1000 * stage.predicted_seconds,
        )
    log.info(
        "layer groups split by %s: slowest stage %.1f ms a micro-batch, a step %.3f s predicted; "
        "split by parameters: %.1f ms, %.3f s; bound by %s",
        split.method,
        1000 * split.slowest_stage_seconds,
        split.predicted_step_seconds,
        1000 * split.slowest_by_parameters_seconds,
        split.predicted_step_by_parameters_seconds,
        split.bound,
    )

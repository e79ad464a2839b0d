"""provision_cluster: the cluster laid out and every replica started (processes, containers or
pods). ``strategy=auto`` is decided here, once: one worker trains on one device; several are first
launched to measure themselves (``hetflow.replica.balance``), and the pipeline's policy
(``hetflow.replica.auto_strategy``) chooses from their numbers. ``train`` supervises the replicas,
``teardown_cluster`` ends them."""

from __future__ import annotations

import logging
from typing import Any

from hetflow.paths import RunPaths, run_paths, write_record
from hetflow.pipeline.attempts import attempt, load_spec, reported
from hetflow.pipeline.interrupt import SIGTERM_STOP_GRACE_SECONDS, stopped_on_sigterm
from hetflow.pipeline.provisioned_by import record_provisioner
from hetflow.spec import RunSpec, parse_spec

log = logging.getLogger("hetflow.stages")
# strategy=auto's decision, which `hetflow run`'s live view shows
auto_log = logging.getLogger("hetflow.auto")


@reported
def provision_cluster(run_id: str, try_number: int | None = None) -> dict[str, Any]:
    """Lay out the cluster and start every replica."""
    from hetflow.cluster import supervisor

    paths = run_paths(run_id)
    with attempt(paths, "provision_cluster", run_id, try_number) as receipt:
        spec = load_spec(paths)
        record_provisioner(paths)
        if spec.cluster.strategy == "auto":
            spec = decide_auto(spec, run_id, paths)
            # The one spec the run trains with; the request stays in requested_spec.json.
            write_record(paths.spec, spec.model_dump(mode="json"))
        if spec.cluster.stage_memory_mb:  # only then can the model's size refuse it (TensorFlow counts it)
            from hetflow.records import DatasetRecord
            from hetflow.replica.stage_profile import refuse_unsplittable

            refuse_unsplittable(spec, DatasetRecord.read(paths))
        cluster = supervisor.start(spec, run_id, paths)
    log.info(
        "started %s on %s: %s",
        ", ".join(r.name for r in cluster.layout.replicas),
        spec.cluster.backend,
        cluster.layout.cluster_spec(),
    )
    return {**cluster.layout.to_dict(), "attempt": receipt}


def decide_auto(requested: RunSpec, run_id: str, paths: RunPaths) -> RunSpec:
    """The spec ``strategy=auto`` decides for ``requested``: one worker trains on one device; several
    are launched as sync all-reduce, measure themselves and stop (``launch_to_measure``), and the
    decision is taken from their probes."""
    write_record(paths.requested_spec, requested.model_dump(mode="json"))
    if requested.cluster.worker.replicas == 1:
        auto_log.info("auto chose one_device: one worker")
        return parse_spec({**requested.flat(), "strategy": "one_device"})
    auto_log.info(
        "auto launches %d workers as sync all-reduce to measure themselves, then decides",
        requested.cluster.worker.replicas,
    )
    launch_to_measure(requested, run_id, paths)
    decided = auto_decided(paths)
    if decided.cluster.strategy == "auto":
        raise RuntimeError(f"strategy=auto: the workers stopped before they measured themselves ({paths.plan})")
    return decided


def launch_to_measure(requested: RunSpec, run_id: str, paths: RunPaths) -> None:
    """Launch ``requested``'s workers, which read ``strategy=auto`` in spec.json as: measure, record the
    probes in plan.json and stop; end what the launch started, also when it fails."""
    from hetflow.cluster import supervisor
    from hetflow.cluster.backends.base import backend_for

    probing = parse_spec({**requested.flat(), "ps": 0})  # the workers alone: a ps has nothing to measure
    backend = backend_for(probing)
    try:
        with stopped_on_sigterm(lambda: backend.teardown(probing, run_id, grace=SIGTERM_STOP_GRACE_SECONDS)):
            cluster = supervisor.start(probing, run_id, paths)
            supervisor.supervise(probing, cluster, paths.root, probing.cluster.run_policy.timeout_seconds)
    finally:
        backend.teardown(probing, run_id)


def auto_decided(paths: RunPaths) -> RunSpec:
    """The spec ``strategy=auto`` decided from the requested spec and the workers' measurements
    (plan.json): the pipeline's policy, from the request it recorded, with only the replicas'
    numbers (checked) and its own code. The request itself where nothing was measured."""
    from hetflow.replica.balance import measured

    requested = RunSpec.from_json(paths.requested_spec.read_text())
    plan = measured(paths, requested)
    if plan is None or plan.decision is None:
        return requested
    auto_log.info("%s", plan.decision.reason)
    return parse_spec({**requested.flat(), **plan.decision.settings})

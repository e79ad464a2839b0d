"""provision_cluster: the cluster laid out and every replica started (processes, containers or
pods); ``strategy=auto`` starts what it can decide without measuring. ``train`` supervises the
replicas, ``teardown_cluster`` ends them."""

from __future__ import annotations

import logging
from typing import Any

from hetflow.paths import run_paths, write_record
from hetflow.pipeline.attempts import attempt, load_spec, reported
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
        if spec.cluster.strategy == "auto":
            write_record(paths.requested_spec, spec.model_dump(mode="json"))
            spec = start_of_auto(spec)
            # From here on the run trains with the resolved spec; the request stays in requested_spec.json.
            write_record(paths.spec, spec.model_dump(mode="json"))
        record_provisioner(paths)
        cluster = supervisor.start(spec, run_id, paths)
    log.info(
        "started %s on %s: %s",
        ", ".join(r.name for r in cluster.layout.replicas),
        spec.cluster.backend,
        cluster.layout.cluster_spec(),
    )
    return {**cluster.layout.to_dict(), "attempt": receipt}


def start_of_auto(spec: RunSpec) -> RunSpec:
    """What ``strategy=auto`` launches: one worker trains on one device; several start as sync
    all-reduce and measure themselves before their first step (``hetflow.replica.balance``), then keep
    equal batches, balance them, or stop so that ``train`` relaunches them as ``one_device`` or
    ``parameter_server`` (``hetflow.replica.auto_strategy`` decides, from what they measured)."""
    if spec.cluster.worker.replicas == 1:
        auto_log.info("auto chose one_device: one worker")
        return parse_spec({**spec.flat(), "strategy": "one_device"})
    auto_log.info(
        "auto starts sync all-reduce on %d workers, which measure themselves before their first step and then "
        "keep equal batches, balance them, or are relaunched as one_device or parameter_server",
        spec.cluster.worker.replicas,
    )
    return parse_spec({**spec.flat(), "strategy": "multi_worker_mirrored", "ps": 0, "balance_batches": True})

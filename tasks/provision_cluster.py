"""provision_cluster: the cluster laid out and every replica started (processes, containers or
pods); ``strategy=auto`` is resolved first, from a probe of the workers. ``train`` supervises the
replicas, ``teardown_cluster`` ends them."""

from __future__ import annotations

import logging
from typing import Any

from tasks.attempts import attempt, load_spec, reported
from tasks.paths import RunPaths, run_paths, write_record
from tasks.spec import RunSpec, parse_spec

log = logging.getLogger("hetflow.stages")
# strategy=auto's decision, which `hetflow run`'s live view shows
auto_log = logging.getLogger("hetflow.auto")

# Runs whose replicas this process started and has not torn down: what `hetflow run` ends when
# interrupted (Ctrl-C), as its DAG's teardown task would not run.
PROVISIONED_HERE: set[str] = set()


@reported
def provision_cluster(run_id: str, try_number: int | None = None) -> dict[str, Any]:
    """Lay out the cluster and start every replica."""
    from tasks.cluster import backends

    paths = run_paths(run_id)
    with attempt(paths, "provision_cluster", run_id, try_number) as receipt:
        spec = load_spec(paths)
        if spec.strategy == "auto":  # balance_batches alone: the workers probe themselves when they start
            spec = plan_training(spec, run_id, paths)
            # From here on the run trains with the resolved spec; the request stays in plan.json.
            write_record(paths.spec, spec.model_dump(mode="json"))
        paths.restarts.unlink(missing_ok=True)  # a re-provisioned run starts its restart count anew
        backend = backends.backend_for(spec)
        layout = backend.plan(spec, run_id)
        write_record(paths.cluster, layout.to_dict())
        cluster = backend.replicas(spec, layout, paths.root)
        PROVISIONED_HERE.add(run_id)
        cluster.provision()
    log.info(
        "started %s on %s: %s", ", ".join(r.name for r in cluster.layout.replicas), spec.backend, layout.cluster_spec()
    )
    return {**cluster.layout.to_dict(), "attempt": receipt}


def plan_training(spec: RunSpec, run_id: str, paths: RunPaths) -> RunSpec:
    """Probe the workers and resolve ``strategy=auto`` (with the batch shares when it chooses
    balanced sync). Writes plan.json and returns the spec to train with (the requested one stays
    in the plan)."""
    from tasks.auto_strategy import decide
    from tasks.batch_shares import split_batch
    from tasks.cluster.probe import probe_workers

    probes = probe_workers(spec, run_id, paths)
    decision = decide(spec, probes)
    auto_log.info("%s", decision["reason"])
    plan: dict[str, Any] = {"requested": spec.model_dump(), "probes": probes, "decision": decision}
    spec = parse_spec({**spec.model_dump(), **decision["settings"]})
    if spec.balance_batches:
        plan["worker_batches"] = split_batch(spec.batch_size, [p["examples_per_second"] for p in probes])
        auto_log.info("balanced per-worker batches: %s", plan["worker_batches"])
    write_record(paths.plan, plan)
    return spec

"""The probe cluster: every worker started alone for a few seconds, all at once (as they will
train), on the run's backend, to measure its speed (``tasks.replica.probe`` runs inside each)."""

from __future__ import annotations

import json
import shutil
from typing import Any

from tasks.cluster import backends
from tasks.paths import RunPaths
from tasks.spec import RunSpec


def probe_workers(spec: RunSpec, run_id: str, paths: RunPaths) -> list[dict[str, Any]]:
    """Run the probe on every worker and collect their measured speed, in worker order."""
    workers_only = spec.model_copy(update={"strategy": "multi_worker_mirrored", "ps": 0})
    backend = backends.backend_for(spec)
    cluster = backend.replicas(spec, backend.plan(workers_only, run_id), paths.root, probe=True)
    shutil.rmtree(paths.probes, ignore_errors=True)  # a retried probe must not meet the last one's barrier marks
    try:
        cluster.provision()
        backends.supervise(spec, cluster, paths.root, spec.train_timeout_seconds)
    finally:
        backend.teardown(spec, run_id)
    return [json.loads((paths.probes / f"worker-{i}.json").read_text()) for i in range(spec.workers)]

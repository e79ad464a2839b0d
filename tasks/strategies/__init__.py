"""Training inside a replica, one module per way of distributing it.

- ``probe``: a short measured run of one worker on its own model, all workers at once (for
  balance_batches and auto).
- ``sync``: one_device, mirrored, multi_worker_mirrored (all-reduce), with equal per-worker
  batches or batches proportional to each worker's speed (``balance_batches``).
- ``parameter_server``: async updates with ``ClusterCoordinator``.
- ``model_parallel``: one replica, layer groups placed on different devices.

All run the same epoch loop (``common.run_epochs``), each with its own step.

Only the chief writes the model and ``training.json``; the supervising Airflow task reads them.
"""

from __future__ import annotations

from typing import Any

from tasks.paths import RunPaths
from tasks.spec import RunSpec


def run_replica(
    spec: RunSpec, dataset: dict[str, Any], paths: RunPaths, task: dict[str, Any], probe: bool = False
) -> None:
    from tasks.strategies.common import configure_runtime

    configure_runtime(spec, task)
    if probe:
        from tasks.strategies.probe import file_barrier, measure

        barrier = file_barrier(paths.probes, f"{task['type']}-{task['index']}", spec.workers)
        measure(spec, dataset, paths, task, barrier)
    elif spec.strategy == "parameter_server":
        from tasks.strategies import parameter_server

        if task["type"] == "chief":
            parameter_server.train(spec, dataset, paths)
        else:
            parameter_server.serve(task)
    elif spec.strategy == "model_parallel":
        from tasks.strategies import model_parallel

        model_parallel.train(spec, dataset, paths)
    else:
        from tasks.strategies import sync

        sync.train(spec, dataset, paths, task)

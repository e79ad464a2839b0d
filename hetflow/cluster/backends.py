"""The backends a run's replicas run on — local processes, Docker containers, Swarm services,
Kubernetes pods — behind one interface, chosen once from ``spec.backend`` (``backend_for``).

A backend plans the run's layout (every replica's address), checks before anything starts what
would stop its replicas from starting (``preflight``), gives the supervisor the run's replicas
(``replicas``: provision, start, poll, stop, their output), ends everything of one run
(``teardown``) and removes what interrupted runs left (``sweep``). What to restart and when a run
has failed is decided by the one supervisor (``hetflow.cluster.supervisor``), never by a backend.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

from hetflow.cluster.layout import ClusterLayout
from hetflow.cluster.supervisor import Replicas, Supervisor
from hetflow.paths import RunPaths, write_record
from hetflow.spec import RunSpec


class Backend(Protocol):
    """What every backend does, for one run at a time (the run named by ``run_id``)."""

    # Seconds the engine may take to report a replica lost with its machine (the supervisor waits
    # that long before blaming a peer that merely exited with an error); 0 where loss is seen at once.
    loss_report_seconds: float

    def plan(self, spec: RunSpec, run_id: str) -> ClusterLayout:
        """Every replica's role, index and address (nothing starts)."""

    def preflight(self, spec: RunSpec, run_id: str) -> list[str]:
        """What would stop the run's replicas from starting, one line each."""

    def replicas(self, spec: RunSpec, layout: ClusterLayout, run_dir: Path) -> Replicas:
        """The run's replicas for the supervisor."""

    def teardown(self, spec: RunSpec, run_id: str, grace: float | None = None) -> list[str]:
        """End everything of the run, found by its run id; the names of what was ended.

        :param grace: the most seconds a replica may take to end once told to (default: the backend's):
            local processes and Kubernetes pods get SIGTERM, then SIGKILL after it; docker's containers
            are killed at once, within any grace. Swarm's tasks are the exception: the engine gives
            them their service's stop grace period, fixed when the service was made
            (``containers.STOP_GRACE_SECONDS``)."""

    def sweep(self, home: Path, grace: float | None = None) -> dict[str, list[str]]:
        """Remove what interrupted runs of ``home`` left and no supervisor holds, by kind.

        :param grace: what started less than this many seconds ago may belong to a run being
            provisioned and is left alone (default: the backend's)."""


# Imported only when chosen: the Docker SDK and the Kubernetes client cost time at import.
_MODULES = {
    "local": "hetflow.cluster.local_backend",
    "docker": "hetflow.cluster.docker_backend",
    "swarm": "hetflow.cluster.swarm_backend",
    "kubernetes": "hetflow.cluster.kubernetes_backend",
}


def backend_for(spec: RunSpec | None) -> Backend:
    """The run's backend. Without a spec (validation failed) only local processes can exist."""
    return importlib.import_module(_MODULES[spec.cluster.backend if spec is not None else "local"]).BACKEND


def sweep(home: Path, attach_seconds: float | None = None) -> dict[str, list]:
    """``hetflow sweep``, and every teardown after its own run's: what interrupted runs of ``home`` left
    on every backend that can leave something — containers and networks (docker), services and overlay
    networks (swarm), the pods, services, NetworkPolicies and ConfigMaps of Kubernetes runs where a
    client configuration is found — of runs no supervisor holds (a local run leaves nothing).

    :param attach_seconds: containers, services and Kubernetes runs younger than this are left alone
        (default: the backends' attach timeout)."""
    removed: dict[str, list] = {}
    for module in _MODULES.values():
        for kind, names in importlib.import_module(module).BACKEND.sweep(home, attach_seconds).items():
            removed[kind] = removed.get(kind, []) + names
    return removed


def start(spec: RunSpec, run_id: str, paths: RunPaths) -> Replicas:
    """Lay out the run's cluster, record the layout (cluster.json) and start every replica."""
    paths.restarts.unlink(missing_ok=True)  # a re-provisioned run starts its restart count anew
    backend = backend_for(spec)
    layout = backend.plan(spec, run_id)
    write_record(paths.cluster, layout.to_dict())
    cluster = backend.replicas(spec, layout, paths.root)
    cluster.provision()
    return cluster


def supervise(
    spec: RunSpec, cluster: Replicas, run_dir: Path, timeout: float, should_stop=None, log_label: str = ""
) -> dict[str, int]:
    """Watch ``cluster`` (provisioned replicas) until training ends: the training replicas' exit
    codes, or ReplicaFailed (StoppedEarly once ``should_stop()`` gives a reason). Local replicas live
    only while a supervisor holds their lease. ``log_label`` names the run in the replicas' log lines."""
    supervisor = Supervisor(
        cluster.layout,
        spec.cluster.run_policy.restart_policy,
        spec.cluster.run_policy.backoff_limit,
        cluster,
        run_dir,
        backend_for(spec).loss_report_seconds,
        log_label,
    )
    cluster.attach()
    try:
        supervisor.follow(r.name for r in cluster.layout.replicas)
        return supervisor.wait(timeout, should_stop=should_stop)
    finally:
        cluster.detach()

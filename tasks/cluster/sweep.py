"""What ``hetflow sweep`` (``tasks.cluster.backends.sweep``) needs to tell what interrupted runs left
behind from what live runs hold.

A run is interrupted when its tasks were killed before teardown ran (SIGKILL, a lost worker).
Local replicas die with their keepers' supervisor lease, and containers at their deadline, but
some things outlive them: a run's network namespace (its name stays in /run/netns), exited
containers and the Docker network of the run. A run is *live* while a supervisor holds its lease
(``tasks.cluster.keeper``), or within ``ATTACH_TIMEOUT_SECONDS`` of its replicas' start (provisioned,
waiting for the train task): the sweep leaves those alone, so it is safe beside running runs and is
what every teardown runs after its own run's.

Kubernetes runs are found by their ConfigMap, which names the run directory (the supervisor's lease
is there, on the claim it shares with the pods); a run no supervisor holds loses its pods, service,
NetworkPolicy and ConfigMap. Without a kubeconfig or a service account there is no cluster to sweep.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tasks.cluster import netns
from tasks.cluster.keeper import lease_path, supervisor_holds_lease

log = logging.getLogger("hetflow.cluster")

# A namespace younger than this may belong to a run being provisioned (created, keepers not yet in).
NAMESPACE_GRACE_SECONDS = 60.0


def _created_at(path: Path) -> float:
    return path.lstat().st_mtime


def empty_namespaces(grace_seconds: float = NAMESPACE_GRACE_SECONDS) -> list[str]:
    """hetflow's network namespaces with no process in them, older than ``grace_seconds``."""
    if not netns.NETNS_DIR.is_dir():
        return []
    now = time.time()
    return sorted(
        path.name
        for path in netns.NETNS_DIR.glob("hetflow-*")
        if now - _created_at(path) > grace_seconds and not netns.namespace_processes(path.name)
    )


def sweep_namespaces(grace_seconds: float = NAMESPACE_GRACE_SECONDS) -> list[str]:
    """Delete hetflow's network namespaces that no process is left in; returns their names."""
    namespaces = empty_namespaces(grace_seconds)
    for name in namespaces:
        netns.delete_namespace(name)
        log.info("sweep: deleted network namespace %s, which no process was left in", name)
    return namespaces


def run_is_live(run_dir: str, started_at: float, home: Path, attach_seconds: float) -> bool:
    """Whether the run may still be supervised; a run of another HETFLOW_HOME always counts as live."""
    path = Path(run_dir)
    if not path.is_relative_to(home / "runs"):
        return True  # another deployment's run: not this sweep's to judge
    if not path.is_dir():
        return False  # its run directory is gone: nothing will supervise it
    if time.time() - started_at < attach_seconds:
        return True  # provisioned, its train task may be about to take it
    return lease_path(path).exists() and supervisor_holds_lease(path)


def docker_time(stamp: str) -> float:
    """Docker's RFC 3339 time with nanoseconds (``2026-11-23T19:01:02.123456789Z``) as a Unix time."""
    from datetime import datetime

    seconds, _, fraction = stamp.rstrip("Z").partition(".")
    moment = datetime.fromisoformat(seconds + "+00:00").timestamp()
    return moment + float(f"0.{fraction[:6] or 0}")

"""``hetflow sweep``: remove what interrupted runs left behind, found by name and label.

A run is interrupted when its tasks were killed before teardown ran (SIGKILL, a lost worker).
Local replicas die with their keepers' supervisor lease, and containers at their deadline, but
some things outlive them: a run's network namespace (its name stays in /run/netns), exited
containers and the Docker network of the run. A run is *live* while a supervisor holds its lease
(``tasks.cluster.keeper``), or within ``ATTACH_TIMEOUT_SECONDS`` of its replicas' start (provisioned,
waiting for the train task): the sweep leaves those alone, so it is safe beside running runs and is
what every teardown runs after its own run's.

Kubernetes objects are not swept: pods end at their activeDeadlineSeconds, and the run's service,
policy and config map are owned by a ConfigMap that teardown deletes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tasks.cluster import netns
from tasks.cluster.keeper import ATTACH_TIMEOUT_SECONDS, lease_path, supervisor_holds_lease

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


def _live(run_dir: str, started_at: float, home: Path, attach_seconds: float) -> bool:
    """Whether the run may still be supervised; a run of another HETFLOW_HOME always counts as live."""
    path = Path(run_dir)
    if not path.is_relative_to(home / "runs"):
        return True  # another deployment's run: not this sweep's to judge
    if not path.is_dir():
        return False  # its run directory is gone: nothing will supervise it
    if time.time() - started_at < attach_seconds:
        return True  # provisioned, its train task may be about to take it
    return lease_path(path).exists() and supervisor_holds_lease(path)


def sweep_containers(home: Path, attach_seconds: float = ATTACH_TIMEOUT_SECONDS) -> dict[str, list[str]]:
    """Remove the containers and networks of this home's runs that no supervisor holds; returns
    their names. Needs a Docker engine; none answering, there is nothing to sweep."""
    import docker

    from tasks.cluster.docker_backend import LABEL_RUN, LABEL_RUN_DIR, LABEL_RUN_ID, teardown_run

    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException:
        return {"containers": [], "networks": []}
    runs: dict[str, tuple[str, float]] = {}  # run id: its run directory, the newest start of its containers
    for container in client.containers.list(all=True, filters={"label": LABEL_RUN}):
        labels = container.labels
        if LABEL_RUN_DIR not in labels:  # made before runs were labelled with their directory
            continue
        started = container.attrs["State"].get("StartedAt") or container.attrs["Created"]
        started_at = _docker_time(started)
        run_dir, newest = runs.get(labels[LABEL_RUN_ID], (labels[LABEL_RUN_DIR], 0.0))
        runs[labels[LABEL_RUN_ID]] = (run_dir, max(newest, started_at))
    removed: dict[str, list[str]] = {"containers": [], "networks": []}
    for run_id, (run_dir, started_at) in sorted(runs.items()):
        if not _live(run_dir, started_at, home, attach_seconds):
            removed["containers"] += teardown_run(run_id, client)
            log.info("sweep: removed the containers and network of interrupted run %s", run_id)
    # A network whose containers are gone (its run was torn down halfway) goes too.
    for network in client.networks.list(filters={"label": LABEL_RUN}):
        network.reload()
        labels = network.attrs.get("Labels") or {}
        created_at = _docker_time(network.attrs["Created"])
        if LABEL_RUN_DIR in labels and not network.attrs.get("Containers"):
            if not _live(labels[LABEL_RUN_DIR], created_at, home, attach_seconds):
                network.remove()
                removed["networks"].append(network.name)
    return removed


def _docker_time(stamp: str) -> float:
    """Docker's RFC 3339 time with nanoseconds (``2026-11-23T19:01:02.123456789Z``) as a Unix time."""
    from datetime import datetime

    seconds, _, fraction = stamp.rstrip("Z").partition(".")
    moment = datetime.fromisoformat(seconds + "+00:00").timestamp()
    return moment + float(f"0.{fraction[:6] or 0}")


def sweep(
    home: Path, attach_seconds: float | None = None, namespace_grace: float | None = None
) -> dict[str, list[str]]:
    """Everything interrupted runs of ``home`` left: empty network namespaces (any home's: they hold
    nothing), and the containers and networks of runs no supervisor holds. The waits default to
    ``ATTACH_TIMEOUT_SECONDS`` and ``NAMESPACE_GRACE_SECONDS``."""
    attach_seconds = ATTACH_TIMEOUT_SECONDS if attach_seconds is None else attach_seconds
    namespace_grace = NAMESPACE_GRACE_SECONDS if namespace_grace is None else namespace_grace
    namespaces = empty_namespaces(namespace_grace)
    for name in namespaces:
        netns.delete_namespace(name)
        log.info("sweep: deleted network namespace %s, which no process was left in", name)
    return {"namespaces": namespaces, **sweep_containers(home, attach_seconds)}

"""What ``hetflow sweep`` (``hetflow.cluster.backends.base.sweep``) needs to tell what interrupted runs left
behind from what live runs hold.

A run is interrupted when its tasks were killed before teardown ran (SIGKILL, a lost worker).
Local replicas and the holder of their network namespace die with their keepers' supervisor lease
(the kernel frees the namespace with its last process), so a local run leaves nothing to sweep;
containers die at their deadline, but exited containers and the Docker network of the run outlive
them. A run is *live* while a supervisor holds its lease (``hetflow.cluster.backends.local.keeper``), or within
``ATTACH_TIMEOUT_SECONDS`` of its replicas' start (provisioned, waiting for the train task): the
sweep leaves those alone, so it is safe beside running runs and is what every teardown runs after
its own run's.

Kubernetes runs are found by their ConfigMap, which names the run directory (the supervisor's lease
is there, on the claim it shares with the pods); a run no supervisor holds loses its pods, service,
NetworkPolicy and ConfigMap. Without a kubeconfig or a service account there is no cluster to sweep.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from hetflow.cluster.lease import ATTACH_TIMEOUT_SECONDS, lease_path, supervisor_holds_lease


def run_is_live(run_dir: str, started_at: float, home: Path, attach_seconds: float | None) -> bool:
    """Whether the run may still be supervised; a run of another HETFLOW_HOME always counts as live.
    One started less than ``attach_seconds`` ago (None: the attach timeout) may be being provisioned."""
    path = Path(run_dir)
    if not path.is_relative_to(home / "runs"):
        return True  # another deployment's run: not this sweep's to judge
    if not path.is_dir():
        return False  # its run directory is gone: nothing will supervise it
    if time.time() - started_at < (ATTACH_TIMEOUT_SECONDS if attach_seconds is None else attach_seconds):
        return True  # provisioned, its train task may be about to take it
    return lease_path(path).exists() and supervisor_holds_lease(path)


def interrupted_runs(parts: Iterable[tuple[str, str, float]], home: Path, attach_seconds: float | None) -> list[str]:
    """The ids of the runs no supervisor holds, sorted, from what a backend found of them: each part
    (a container, a service) as its run's id, its run directory and when it started; a run is as
    young as its newest part."""
    runs: dict[str, tuple[str, float]] = {}
    for run_id, run_dir, started_at in parts:
        first_dir, newest = runs.get(run_id, (run_dir, 0.0))
        runs[run_id] = (first_dir, max(newest, started_at))
    return [
        run_id
        for run_id, (run_dir, newest) in sorted(runs.items())
        if not run_is_live(run_dir, newest, home, attach_seconds)
    ]


def docker_time(stamp: str) -> float:
    """Docker's RFC 3339 time with nanoseconds (``2026-11-23T19:01:02.123456789Z``) as a Unix time."""
    from datetime import datetime

    seconds, _, fraction = stamp.rstrip("Z").partition(".")
    moment = datetime.fromisoformat(seconds + "+00:00").timestamp()
    return moment + float(f"0.{fraction[:6] or 0}")

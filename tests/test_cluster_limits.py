"""A local replica's memory and task limits (``hetflow.cluster.backends.local.limits``): a hostile process in a
replica's sandbox, started as its keeper starts a replica (inside its cgroups), forks and allocates
until the kernel stops it at the replica's limits, not at the host's. Real cgroups, real sandboxes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hetflow import sandbox
from hetflow.cluster.backends.local import limits
from hetflow.cluster.backends.local.keeper import _replica_preexec

_FORK_BOMB = textwrap.dedent(
    """
    import os, time
    forked = 0
    try:
        for _ in range(200):  # bounded, so that a missing limit fails the test instead of the host
            if os.fork() == 0:
                time.sleep(3)
                os._exit(0)
            forked += 1
    except OSError as error:
        print("refused", error.errno)
    print("forked", forked)
    """
)
_MEMORY_HOG = "hog = bytearray(400 * 2**20)\nprint('allocated', len(hog))"


def _in_replica_cgroups(bounds, run_dir, code: str) -> subprocess.CompletedProcess:
    box = sandbox.Sandbox(owner=sandbox.run_owner(run_dir))
    try:
        return subprocess.run(
            box.command([sys.executable, "-c", code]),
            pass_fds=box.fds,
            preexec_fn=_replica_preexec(None, bounds),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        box.close()


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(limits.CGROUP_ROOT / "pids", os.W_OK), reason="needs root and cgroup v1"
)
def test_a_replicas_fork_bomb_and_memory_hog_stop_at_its_own_limits(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "REPLICA_TASKS", 64)
    run_dir = tmp_path / "run"
    cgroups = limits.make(run_dir, "worker-0", memory_mb=200)
    try:
        bomb = _in_replica_cgroups(cgroups, run_dir, _FORK_BOMB)
        hog = _in_replica_cgroups(cgroups, run_dir, _MEMORY_HOG)
    finally:
        cgroups.remove()
    assert bomb.returncode == 0, bomb.stderr
    seen = dict(line.split(" ", 1) for line in bomb.stdout.splitlines())
    assert seen["refused"] == "11"  # EAGAIN: the cgroup's pids.max
    assert int(seen["forked"]) < 64
    assert "allocated" not in hog.stdout and hog.returncode != 0  # the OOM killer ended it at 200 MiB
    assert not any(directory.exists() for directory in cgroups.directories)


def test_where_no_cgroup_can_be_made_the_keeper_is_told_in_one_line(tmp_path):
    with pytest.raises(limits.LimitsUnavailable) as refused:
        limits.make(tmp_path / "run", "worker-0", memory_mb=0, root=tmp_path / "no-cgroups")
    hierarchy = tmp_path / "no-cgroups" / "pids"
    assert str(refused.value) == f"no writable cgroup v1 pids hierarchy at {hierarchy} to limit worker-0"


def test_where_no_cgroup_can_be_made_the_replicas_tasks_are_limited_and_its_log_says_what_is_not(tmp_path, monkeypatch):
    from hetflow.cluster.backends.local import keeper

    monkeypatch.setattr(limits, "CGROUP_ROOT", tmp_path / "cgroup-v2-only")
    log_path = tmp_path / "worker-0.log"
    with open(log_path, "ab") as log_file:
        bounds = keeper._replica_limits(tmp_path / "run", "worker-0", 200, log_file)
    assert bounds == limits.ReplicaRlimits(200)
    hierarchy = tmp_path / "cgroup-v2-only" / "pids"
    assert log_path.read_text() == (
        f"hetflow keeper: worker-0 has no cgroup (no writable cgroup v1 pids hierarchy at {hierarchy} to limit "
        f"worker-0): limited to {limits.REPLICA_TASKS} tasks for the run's uid (RLIMIT_NPROC); "
        "replica_memory_mb=200 is not enforced without a cgroup\n"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="a uid of the run's own needs root")
def test_without_cgroups_a_replicas_fork_bomb_stops_at_its_runs_task_limit(tmp_path, monkeypatch):
    """As on a cgroup v2 host: the fork bomb, started as the keeper starts a replica there."""
    monkeypatch.setattr(limits, "REPLICA_TASKS", 64)
    bomb = _in_replica_cgroups(limits.ReplicaRlimits(memory_mb=0), tmp_path / "run", _FORK_BOMB)
    assert bomb.returncode == 0, bomb.stderr
    seen = dict(line.split(" ", 1) for line in bomb.stdout.splitlines())
    assert seen["refused"] == "11"  # EAGAIN: RLIMIT_NPROC of the run's uid
    assert int(seen["forked"]) < 64

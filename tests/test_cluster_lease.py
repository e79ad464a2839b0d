"""The run's supervisor lease and heartbeat, and the rule by which a replica decides that its
supervisor is gone (hetflow.cluster.lease): the rule on its own, then real processes holding, killed
while holding, and watching."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, wait_for

from hetflow.cluster.lease import (
    SUPERVISOR_GONE_EXIT_CODE,
    Supervision,
    heartbeat_path,
    lease_path,
    read_heartbeat,
    supervisor_holds_lease,
    take_lease,
)
from hetflow.cluster.supervisor import ReplicaFailed

# --- the rule, on what is seen at given times ---------------------------------------------------------


def test_a_lease_held_and_then_released_means_gone_at_once():
    watch = Supervision(started=0.0, signals=["lease"], attach_timeout=600)
    assert watch.gone(1.0, lease_held=False) is None  # not taken yet: the train task may be starting
    assert watch.gone(2.0, lease_held=True) is None
    assert watch.gone(500.0, lease_held=True) is None
    assert watch.gone(502.0, lease_held=False) == "it no longer holds the run's lease (replicas/supervisor.lock)"


def test_a_lease_never_taken_means_gone_after_the_attach_timeout_only():
    watch = Supervision(started=100.0, signals=["lease"], attach_timeout=600)
    assert watch.gone(699.0, lease_held=False) is None
    assert watch.gone(701.0, lease_held=False) == "no supervisor took the run within 600 s of the replica's start"


def test_a_heartbeat_counts_once_it_changes_and_is_gone_once_stale():
    watch = Supervision(started=0.0, signals=["heartbeat"], attach_timeout=600, stale_after=10)
    # A file an earlier supervisor left: a baseline, no sign of life, however long it stays.
    assert watch.gone(1.0, heartbeat=b"111\n") is None
    assert watch.gone(30.0, heartbeat=b"111\n") is None
    assert watch.gone(32.0, heartbeat=b"222\n") is None  # it changed: a supervisor beats
    assert watch.gone(41.0, heartbeat=b"222\n") is None  # 9 s without a change
    assert watch.gone(43.0, heartbeat=b"333\n") is None
    # Removed (a teardown took the run directory) is no beat either.
    assert watch.gone(50.0, heartbeat=None) is None
    assert watch.gone(54.0, heartbeat=None) == (
        "its heartbeat (replicas/supervisor.heartbeat) has not changed for 11 s"
    )


def test_a_heartbeat_that_never_changes_is_a_supervisor_that_never_came():
    watch = Supervision(started=0.0, signals=["heartbeat"], attach_timeout=600, stale_after=10)
    assert watch.gone(0.0, heartbeat=b"left by an earlier supervisor\n") is None
    assert watch.gone(599.0, heartbeat=b"left by an earlier supervisor\n") is None
    assert watch.gone(601.0, heartbeat=b"left by an earlier supervisor\n") == (
        "no supervisor took the run within 600 s of the replica's start"
    )


def test_a_lease_seen_decides_over_the_heartbeat_which_decides_where_no_lease_is_seen():
    both = Supervision(started=0.0, signals=["lease", "heartbeat"], attach_timeout=600, stale_after=10)
    assert both.gone(0.0, lease_held=True, heartbeat=b"1") is None
    assert both.gone(2.0, lease_held=True, heartbeat=b"2") is None
    # A heartbeat late behind a busy supervisor, whose lease is held: still supervised.
    assert both.gone(30.0, lease_held=True, heartbeat=b"2") is None
    # The lease goes (same kernel): gone at once, whatever the heartbeat says.
    assert both.gone(31.0, lease_held=False, heartbeat=b"3") == (
        "it no longer holds the run's lease (replicas/supervisor.lock)"
    )
    # An engine in another kernel never sees the lease held: the heartbeat alone decides.
    elsewhere = Supervision(started=0.0, signals=["lease", "heartbeat"], attach_timeout=600, stale_after=10)
    for now, beat in ((0.0, b"1"), (2.0, b"2"), (700.0, b"3")):
        assert elsewhere.gone(now, lease_held=False, heartbeat=beat) is None
    assert elsewhere.gone(711.0, lease_held=False, heartbeat=b"3") is not None
    heartbeat_only = Supervision(started=0.0, signals=["heartbeat"], attach_timeout=600, stale_after=10)
    assert heartbeat_only.gone(0.0, heartbeat=b"1") is None
    assert heartbeat_only.gone(2.0, lease_held=False, heartbeat=b"2") is None  # a lease it does not watch


# --- real processes -----------------------------------------------------------------------------------

_HOLD = """
import sys, time
from pathlib import Path
from hetflow.cluster.lease import take_lease
lease = take_lease(Path(sys.argv[1]), heartbeat=sys.argv[2] == "heartbeat")
print("held", flush=True)
time.sleep(600)
"""

_WATCH = """
import sys, time
from pathlib import Path
from hetflow.cluster.lease import SupervisorWatch
SupervisorWatch(Path(sys.argv[1]), sys.argv[2:])
time.sleep(600)
"""


def _python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_a_lease_is_seen_held_by_another_process_and_released_when_it_is_killed(tmp_path):
    assert not supervisor_holds_lease(tmp_path)  # no lock file: nobody took it
    holder = _python(_HOLD, str(tmp_path), "lease")
    try:
        assert holder.stdout.readline() == "held\n"
        assert supervisor_holds_lease(tmp_path)
        with pytest.raises(ReplicaFailed, match="another process supervises the replicas of"):
            take_lease(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert not supervisor_holds_lease(tmp_path)  # the kernel dropped the dead holder's lock
    take_lease(tmp_path).close()


def test_taking_the_lease_waits_out_a_probes_brief_shared_lock(tmp_path):
    lease_path(tmp_path).parent.mkdir(parents=True)
    probe = open(lease_path(tmp_path), "a+")
    fcntl.flock(probe, fcntl.LOCK_SH)  # as a keeper's, a replica's or a sweep's probe holds it, briefly
    released = []

    def release():
        released.append(time.monotonic())  # before the lock goes: the lease cannot be taken earlier
        probe.close()

    threading.Timer(0.3, release).start()
    lease = take_lease(tmp_path)  # raises ReplicaFailed where it does not wait
    try:
        assert released, "the lease was taken while the probe held its shared lock"
        assert supervisor_holds_lease(tmp_path)
    finally:
        lease.close()
    assert not supervisor_holds_lease(tmp_path)


def test_the_heartbeat_changes_while_the_lease_is_held_and_stops_with_it(tmp_path):
    lease = take_lease(tmp_path, heartbeat=True)
    first = read_heartbeat(tmp_path)
    assert first is not None
    assert wait_for(lambda: read_heartbeat(tmp_path) != first, timeout=5, interval=0.1)
    lease.close()
    last = read_heartbeat(tmp_path)
    time.sleep(2.5)
    assert read_heartbeat(tmp_path) == last
    assert not os.path.islink(heartbeat_path(tmp_path))


@pytest.mark.parametrize(
    "signals, reason, within",
    [
        (["lease"], "it no longer holds the run's lease (replicas/supervisor.lock)", 4),  # one look every 2 s
        (["lease", "heartbeat"], "it no longer holds the run's lease (replicas/supervisor.lock)", 4),
        # Stale after 10 s without a change, seen within the next look.
        (["heartbeat"], "its heartbeat (replicas/supervisor.heartbeat) has not changed for 1", 15),
    ],
)
def test_a_watching_process_ends_itself_within_seconds_of_its_supervisors_sigkill(tmp_path, signals, reason, within):
    holder = _python(_HOLD, str(tmp_path), "heartbeat")
    watcher = None
    try:
        assert holder.stdout.readline() == "held\n"
        watcher = _python(_WATCH, str(tmp_path), *signals)
        time.sleep(4.5)  # it sees the lease held and the heartbeat change
        assert watcher.poll() is None
        holder.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        output, _ = watcher.communicate(timeout=within + 5)
        took = time.monotonic() - killed
    finally:
        holder.kill()
        if watcher is not None:
            watcher.kill()
    assert watcher.returncode == SUPERVISOR_GONE_EXIT_CODE
    assert f"its supervisor is gone: {reason}" in output
    assert took < within

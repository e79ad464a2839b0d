"""hetflow.serving.haproxy: Debian's HAProxy started and stopped by the balancer: its files private, a
stop heard at once and leaving no process, HAProxy dying with its owner however the owner ends, a
failed start's cause in one line."""

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hetflow.cluster.processes import group_members
from hetflow.serving.balancer import Balancer, BalancerError
from hetflow.serving.server import free_port

pytestmark = pytest.mark.skipif(not Path("/usr/sbin/haproxy").exists(), reason="Debian's haproxy: make sandbox")


def _gone_within(pgid, seconds):
    deadline = time.monotonic() + seconds
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return group_members(pgid) == []


def test_files_are_private_and_stop_leaves_no_process(tmp_path):
    lb = Balancer(tmp_path / "lb", port=free_port()).start()
    pgid = lb.pid
    assert len(group_members(pgid)) >= 2  # the master and its worker
    for path in (lb.config_path, lb.log_path, lb.admin_socket, lb.master_socket, lb.run_dir / "status.map"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    with pytest.raises(ValueError, match="already running"):
        lb.start()
    lb.stop()
    assert _gone_within(pgid, 3), group_members(pgid)
    assert not lb.running


def test_a_stop_right_after_start_is_heard_at_once(tmp_path):
    """A SIGUSR1 sent before HAProxy's master set its handlers was lost (one start in three here), and
    stop() then waited out its whole grace."""
    for attempt in range(5):
        lb = Balancer(tmp_path / f"lb{attempt}", port=free_port()).start()
        started = time.monotonic()
        lb.stop(grace_s=3)
        assert time.monotonic() - started < 1
    lb.stop()  # twice is harmless


@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_haproxy_dies_with_its_owner(tmp_path, signal_number):
    """SIGKILL and SIGTERM (no handler) end the owner at once: PDEATHSIG ends HAProxy; Ctrl-C unwinds
    it, and stop() runs at exit."""
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import time
        from hetflow.serving.balancer import Balancer
        lb = Balancer({str(tmp_path / "lb")!r}, port={free_port()}).start()
        print(lb.pid, flush=True)
        time.sleep(60)
    """),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        pgid = int(owner.stdout.readline())
        assert len(group_members(pgid)) >= 2
    finally:
        owner.send_signal(signal_number)
        owner.wait()
    left = [] if _gone_within(pgid, 3) else group_members(pgid)
    if left:
        os.killpg(pgid, signal.SIGKILL)  # the test fails, and leaves nothing behind either
    assert left == []


def test_a_failed_start_says_why_in_one_line_and_leaves_no_process(tmp_path):
    with Balancer(tmp_path / "first", port=free_port()) as first:
        second = Balancer(tmp_path / "second", port=first.port)
        with pytest.raises(BalancerError, match="haproxy exited") as failure:
            second.start()
    assert "\n" not in str(failure.value) and "cannot bind socket" in str(failure.value)
    assert second.pid is None

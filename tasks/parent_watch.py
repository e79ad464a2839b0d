"""``python -m tasks.parent_watch PARENT_PID -- COMMAND...``: run COMMAND, and end it with everything it
started when the process PARENT_PID is gone.

For helper processes the pipeline starts and must not outlive it, even when the pipeline is killed
with SIGKILL (Airflow's second signal), which leaves no chance to clean up: the MLflow model server
of the served check. Started with ``start_new_session``, the watcher leads a process group that
COMMAND and its children join; the starter ends that group as usual, and when the starter dies the
watcher does it instead (SIGTERM, then SIGKILL after ``GRACE_SECONDS``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

GRACE_SECONDS = 10.0
_POLL_SECONDS = 0.5


def group_members(pgid: int) -> list[int]:
    """Live processes (zombies excluded) of a process group."""
    members = []
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == pgid:
                members.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def _end_group() -> None:
    group = os.getpgid(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the watcher outlives the SIGTERM to wait for the rest
    os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline and set(group_members(group)) - {os.getpid()}:
        try:
            os.waitpid(-1, os.WNOHANG)  # reap the command, so that it does not count as a member
        except ChildProcessError:
            pass
        time.sleep(0.1)
    os.killpg(group, signal.SIGKILL)  # also ends the watcher


def main(argv: list[str]) -> int:
    parent, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: python -m tasks.parent_watch PARENT_PID -- COMMAND...")
    child = subprocess.Popen(command)
    # A SIGTERM to the watcher alone (not to its group) ends the command too.
    signal.signal(signal.SIGTERM, lambda signum, frame: _end_group())
    while child.poll() is None:
        if os.getppid() != int(parent):  # re-parented: the starter is gone
            _end_group()
        time.sleep(_POLL_SECONDS)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

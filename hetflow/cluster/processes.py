"""A run's processes, found by the run id and HETFLOW_HOME in their environment whatever started them
(a keeper, a probe, a task of an earlier try), and ended: process group by process group, SIGTERM
then SIGKILL.

Only processes of this user namespace count: a sandboxed process (``hetflow.sandbox``) can write any
environment it likes, and need not be found, as it dies with its sandbox's bwrap, which is here."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from hetflow.paths import hetflow_home

RUN_ID_ENV = "HETFLOW_RUN_ID"
TERM_GRACE_SECONDS = 10.0


def start_ticks(pid: int) -> int | None:
    """The clock ticks from boot to the process's start (field 22 of /proc/PID/stat): with the pid, on
    one boot, it names one process, where a pid alone is reused. None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2, the command name, may hold spaces and parentheses: count the fields after its ')'.
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def is_running(pid: int) -> bool:
    """Whether the process is alive: a zombie is not (a keeper started by another stage's process
    stays one until that process exits), and a child of ours that exited is reaped here."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop_process_groups(pids: list[int], grace: float = TERM_GRACE_SECONDS) -> list[int]:
    """SIGTERM each process group, then SIGKILL what is left after ``grace`` seconds.

    The escalation is needed: a TF worker waiting for a peer ignores SIGTERM (TF's preemption
    handler catches it). Returns the pids that were still alive.
    """
    alive = [pid for pid in pids if signal_group(pid, signal.SIGTERM)]
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        alive_now = [pid for pid in alive if is_running(pid)]
        if not alive_now:
            break
        time.sleep(0.1)
    for pid in alive:
        signal_group(pid, signal.SIGKILL)
    _reap(alive)
    return alive


def signal_group(pid: int, sig: int) -> bool:
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _reap(pids: list[int], within: float = 1.0) -> None:
    """Collect exit statuses of our own children so they do not linger as zombies until this
    process exits. A child just SIGKILLed takes a moment to die: it is waited for, up to ``within``
    seconds; a pid that is not our child is passed at once."""
    waiting, deadline = list(pids), time.monotonic() + within
    while waiting:
        for pid in list(waiting):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    waiting.remove(pid)
            except ChildProcessError:
                waiting.remove(pid)
        if not waiting or time.monotonic() >= deadline:
            return
        time.sleep(0.02)


def environments_with(*entries: str, anywhere: bool = False) -> dict[int, list[bytes]]:
    """The environment of every live process whose environment holds all ``entries``
    (``NAME=value``), by pid: of this user namespace's processes, or with ``anywhere`` of every
    process (a sandboxed one's environment is what it says it is)."""
    needles = [entry.encode() for entry in entries]
    ours = os.stat("/proc/self/ns/user").st_ino
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if not anywhere and os.stat(entry / "ns" / "user").st_ino != ours:
                continue
        except OSError:
            continue
        if all(needle in environ for needle in needles):
            found[int(entry.name)] = environ
    return found


def _run_environments(run_id: str, home: Path | None = None, anywhere: bool = False) -> dict[int, list[bytes]]:
    """Two homes may hold runs of one id: a run is its id and its HETFLOW_HOME."""
    return environments_with(f"{RUN_ID_ENV}={run_id}", f"HETFLOW_HOME={home or hetflow_home()}", anywhere=anywhere)


def run_processes(run_id: str, home: Path | None = None) -> list[int]:
    """Pids of every live process here (keepers, sandboxes' bwrap) that carries this run's id and
    home in its environment."""
    return list(_run_environments(run_id, home))


def run_replicas(run_id: str, home: Path | None = None) -> dict[str, int]:
    """Pid of each live replica of the run (the replica's own process, inside its sandbox if it has
    one; not its keeper or bwrap), by name (``worker-1``), read from its TF_CONFIG."""
    replicas = {}
    for pid, environ in _run_environments(run_id, home, anywhere=True).items():
        config = next((e for e in environ if e.startswith(b"TF_CONFIG=")), None)
        try:
            replica = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"hetflow.replica"]
        except OSError:
            continue
        if config is not None and replica:
            task = json.loads(config.split(b"=", 1)[1])["task"]
            replicas[f"{task['type']}-{task['index']}"] = pid
    return replicas


def teardown_run(run_id: str, grace: float = TERM_GRACE_SECONDS) -> list[int]:
    """End every process of the run (its id under this HETFLOW_HOME), whatever started it. Returns
    the pids ended."""
    return _end(run_processes(run_id), grace)


def teardown_runs_of_home(home: Path) -> list[int]:
    """End every replica and keeper of any run under ``HETFLOW_HOME=home``, found by the
    environment its task gave it: what ``make down`` does for the runs it interrupts (a run
    provisioned but not yet supervised lives until its keepers' attach timeout). Returns the pids."""
    prefix = f"{RUN_ID_ENV}=".encode()
    pids = [
        pid
        for pid, environ in environments_with(f"HETFLOW_HOME={home}").items()
        if any(entry.startswith(prefix) for entry in environ)
    ]
    return _end(pids)


def _end(pids: list[int], grace: float = TERM_GRACE_SECONDS) -> list[int]:
    """Stop the pids' process groups; kill any pid left (a keeper outside its own group)."""
    if pids:
        stop_process_groups(pids, grace)
        for pid in pids:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5  # a SIGKILLed process takes a moment to leave
        while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
    return pids


def group_members(pgid: int) -> list[int]:
    """Live processes (zombies excluded) of a process group."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members

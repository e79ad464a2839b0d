"""A run's processes, found by the run id in their environment whatever started them (a keeper, a
probe, a task of an earlier try), and ended: process group by process group, SIGTERM then SIGKILL,
with the run's network namespace."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from tasks.cluster.netns import delete_namespace, namespace_name, namespace_processes
from tasks.paths import hetflow_home

RUN_ID_ENV = "HETFLOW_RUN_ID"
TERM_GRACE_SECONDS = 10.0


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


def _reap(pids: list[int]) -> None:
    """Collect exit statuses of our own children so they do not linger as zombies."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def environments_with(*entries: str) -> dict[int, list[bytes]]:
    """The environment of every live process whose environment holds all ``entries``
    (``NAME=value``), by pid."""
    needles = [entry.encode() for entry in entries]
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(needle in environ for needle in needles):
            found[int(entry.name)] = environ
    return found


def _run_environments(run_id: str) -> dict[int, list[bytes]]:
    return environments_with(f"{RUN_ID_ENV}={run_id}")


def run_processes(run_id: str) -> list[int]:
    """Pids of every live process that carries this run's id in its environment."""
    return list(_run_environments(run_id))


def run_replicas(run_id: str) -> dict[str, int]:
    """Pid of each live replica of the run (not its keeper), by name (``worker-1``), read from its
    TF_CONFIG."""
    replicas = {}
    for pid, environ in _run_environments(run_id).items():
        config = next((e for e in environ if e.startswith(b"TF_CONFIG=")), None)
        try:
            replica = b"tasks.replica" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if config is not None and replica:
            task = json.loads(config.split(b"=", 1)[1])["task"]
            replicas[f"{task['type']}-{task['index']}"] = pid
    return replicas


def teardown_run(run_id: str, grace: float = TERM_GRACE_SECONDS) -> list[int]:
    """End every process of the run, found by run id whatever started it, and delete its network
    namespace. Returns the pids ended."""
    return _end(run_processes(run_id), [namespace_name(run_id, hetflow_home())], grace)


def teardown_runs_of_home(home: Path) -> list[int]:
    """End every replica and keeper of any run under ``HETFLOW_HOME=home``, found by the
    environment its task gave it: what ``make down`` does for the runs it interrupts (a run
    provisioned but not yet supervised lives until its keepers' attach timeout), and delete those
    runs' network namespaces. Returns the pids."""
    prefix = f"{RUN_ID_ENV}=".encode()
    pids, run_ids = [], set()
    for pid, environ in environments_with(f"HETFLOW_HOME={home}").items():
        ids = [entry[len(prefix) :].decode() for entry in environ if entry.startswith(prefix)]
        if ids:
            pids.append(pid)
            run_ids.update(ids)
    return _end(pids, [namespace_name(run_id, home) for run_id in sorted(run_ids)])


def _end(pids: list[int], namespaces: list[str], grace: float = TERM_GRACE_SECONDS) -> list[int]:
    """Stop the pids' process groups and whatever else is in the run's namespaces; kill any pid left
    (a keeper outside its own group); delete the namespaces once their processes are gone."""
    pids = pids + [pid for name in namespaces for pid in namespace_processes(name) if pid not in pids]
    if pids:
        stop_process_groups(pids, grace)
        for pid in pids:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5  # a SIGKILLed process takes a moment to leave
        while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
    for name in namespaces:
        delete_namespace(name)
    return pids

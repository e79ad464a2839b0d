"""Local backend: every replica is a subprocess on 127.0.0.1.

Each replica runs ``python -m tasks.replica`` with its own ``TF_CONFIG`` and ``HETFLOW_RUN_ID``,
in its own process group (so teardown can end it with everything it started), and dies with the
process that started it (Linux parent-death signal), so a killed supervisor leaves no orphan.
Its output goes line by line to the supervisor's log, prefixed by the replica's name, and to
``logs/<role>-<index>.log`` in the run directory.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from tasks.cluster.layout import ClusterLayout, Replica, free_local_port
from tasks.paths import REPO_ROOT, RunPaths
from tasks.spec import RunSpec

log = logging.getLogger("hetflow.cluster")

RUN_ID_ENV = "HETFLOW_RUN_ID"
_PR_SET_PDEATHSIG = 1
_TERM_GRACE_SECONDS = 10.0


class ReplicaFailed(RuntimeError):
    pass


def _replica_preexec(core: int | None):
    """Runs in the child before exec: die with the supervisor; optionally stay on one core."""

    def preexec() -> None:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if core is not None:
            os.sched_setaffinity(0, {core})

    return preexec


def core_assignment(layout: ClusterLayout) -> dict[str, int]:
    """One core per replica, round robin; workers first, as they do the compute, then ps, then
    the chief (which under parameter_server only coordinates)."""
    cores = sorted(os.sched_getaffinity(0))
    order = {"worker": 0, "ps": 1, "chief": 2}
    replicas = sorted(layout.replicas, key=lambda r: (order[r.role], r.index))
    return {replica.name: cores[i % len(cores)] for i, replica in enumerate(replicas)}


def visible_gpus(layout: ClusterLayout, spec: RunSpec) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES per replica: each GPU worker gets its own GPUs, in worker order; CPU
    workers, the chief of parameter_server and the ps see none."""
    visible, next_gpu = {}, 0
    for replica in layout.replicas:
        device = spec.worker_device(replica.index) if replica.role == "worker" else None
        if device is not None and device.device == "gpu":
            visible[replica.name] = ",".join(str(next_gpu + i) for i in range(device.count))
            next_gpu += device.count
        else:
            visible[replica.name] = ""
    return visible


class Throttle(threading.Thread):
    """Simulates a machine ``slowdown`` times slower: the replica's process group runs for
    1/slowdown of the time and is stopped (SIGSTOP) for the rest, the way ``cpulimit`` does.
    A real limit on CPU time from outside the process, not a sleep inside the training loop."""

    # Short, so the replica is slow all the time rather than absent for long stretches: with 100 ms
    # it was stopped for 50 ms at a time (slowdown 2) and every collective could wait that long.
    PERIOD_SECONDS = 0.02
    MAX_STOP_PERIODS = 4

    def __init__(self, pid: int, slowdown: float):
        super().__init__(daemon=True)
        self.pid, self.running_share = pid, 1.0 / slowdown
        self.done = threading.Event()

    def run(self) -> None:
        running_phase = self.PERIOD_SECONDS * self.running_share
        # The moment at which what the replica has run so far is its share of the time.
        even_at = continued_at = time.monotonic()
        while True:
            if self._wait_until(continued_at + running_phase):
                break
            if not _signal_group(self.pid, signal.SIGSTOP):
                return
            stopped_at = time.monotonic()
            # Resume at that moment, so a late SIGSTOP lengthens the stop to match: this thread
            # wakes 2-3 ms late when the scheduler puts it on the replica's busy core, and with
            # fixed phases slowdown 4 gave the replica 0.34 of a core, slowdown 2 0.57. A stop lasts
            # at most MAX_STOP_PERIODS; longer debt (this thread stalled) is forgotten rather than
            # paid back in one long absence.
            even_at += (stopped_at - continued_at) / self.running_share
            even_at = min(max(even_at, stopped_at), stopped_at + self.MAX_STOP_PERIODS * self.PERIOD_SECONDS)
            stop_requested = self._wait_until(even_at)
            continued_at = time.monotonic()  # before the call: the replica runs before kill() returns
            _signal_group(self.pid, signal.SIGCONT)
            if stop_requested:
                break
        _signal_group(self.pid, signal.SIGCONT)

    def _wait_until(self, deadline: float) -> bool:
        """Sleeps until ``deadline`` (monotonic); True when stop() was called meanwhile."""
        return self.done.wait(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=1)


def port_taken(port: int) -> bool:
    """Whether something listens on ``port`` (on any interface: TF servers bind 0.0.0.0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def restartable(policy: str, exit_code: int) -> bool:
    """Whether restart_policy restarts a replica that exited with ``exit_code`` (TFJob's policies):
    ``exit_code`` restarts only what was killed by a signal (negative here, or 128+N from a shell),
    taking codes 1-127 for errors a restart would repeat."""
    if policy == "on_failure":
        return True
    return policy == "exit_code" and (exit_code < 0 or exit_code > 128)


class LocalCluster:
    """Starts, watches and stops the replicas of one run."""

    def __init__(self, layout: ClusterLayout, spec: RunSpec, run_dir: Path, logs_dir: Path, probe: bool = False):
        """``probe``: start the workers to measure their speed alone (``tasks.replica --probe``)."""
        self.layout = layout
        self.probe = probe
        self.spec = spec
        self.run_dir = run_dir
        self.logs_dir = logs_dir
        self.cores = core_assignment(layout) if spec.pin_cores else {}
        self.gpus = visible_gpus(layout, spec)
        self.throttles: list[Throttle] = []
        self.restarts: list[dict] = []
        self._started_at = time.monotonic()
        self.processes: dict[str, subprocess.Popen] = {}
        self._tails: dict[str, deque[str]] = {}
        self._pumps: list[threading.Thread] = []

    def start(self) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._move_off_taken_ports()

        for replica in self.layout.replicas:
            self._start_replica(replica)

    def _move_off_taken_ports(self) -> None:
        """Ports were picked free at provisioning; whatever took one since, the replica moves to
        another (and every TF_CONFIG with it, as they name each other)."""
        replicas = []
        for replica in self.layout.replicas:
            host, port = replica.address.rsplit(":", 1)
            if port_taken(int(port)):
                moved = f"{host}:{free_local_port()}"
                log.warning("port %s of %s is taken: %s uses %s instead", port, replica.name, replica.name, moved)
                replica = dataclasses.replace(replica, address=moved)
            replicas.append(replica)
        if tuple(replicas) != self.layout.replicas:
            self.layout = ClusterLayout(self.layout.run_id, tuple(replicas))
            RunPaths(self.run_dir).cluster.write_text(json.dumps(self.layout.to_dict(), indent=2))

    def _start_replica(self, replica: Replica) -> None:
        env = {
            **os.environ,
            "TF_CONFIG": self.layout.tf_config(replica),
            RUN_ID_ENV: self.layout.run_id,
            "HETFLOW_LAUNCH_TIME": repr(time.time()),
            "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": self.gpus[replica.name],
        }
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tasks.replica",
                "--run-dir",
                str(self.run_dir),
                *(["--probe"] if self.probe else []),
            ],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_replica_preexec(self.cores.get(replica.name)),
        )
        self.processes[replica.name] = process
        self._tails[replica.name] = deque(maxlen=20)
        pump = threading.Thread(target=self._pump, args=(replica.name, process), daemon=True)
        pump.start()
        self._pumps.append(pump)
        notes = []
        if replica.name in self.cores:
            notes.append(f"pinned to core {self.cores[replica.name]}")
        slowdown = self.spec.worker_device(replica.index).slowdown if replica.role == "worker" else 1.0
        if slowdown > 1:
            throttle = Throttle(process.pid, slowdown)
            throttle.start()
            self.throttles.append(throttle)
            notes.append(f"throttled to 1/{slowdown:g} of the CPU time (simulated slower machine)")
        log.info(
            "started %s (pid %d) at %s%s", replica.name, process.pid, replica.address, "".join(f", {n}" for n in notes)
        )

    def _pump(self, name: str, process: subprocess.Popen) -> None:
        log_name = f"probe-{name}" if self.probe else name
        # Appended: a restarted replica's output follows its previous attempt's.
        with open(self.logs_dir / f"{log_name}.log", "a", encoding="utf-8") as log_file:
            for raw in process.stdout:
                line = raw.decode("utf-8", "replace").rstrip()
                log_file.write(line + "\n")
                log_file.flush()
                self._tails[name].append(line)
                log.info("[%s] %s", log_name, line)

    def wait(self, timeout: float) -> dict[str, int]:
        """Block until every training replica has exited 0, then stop the server replicas.

        Raises, after stopping the rest, on the first replica that fails, on a server replica
        that exits by itself, and when ``timeout`` seconds pass first.
        """
        serving = {r.name for r in self.layout.replicas if r.serves_until_stopped}
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                running = ", ".join(name for name, p in self.processes.items() if p.poll() is None)
                self.stop()
                self._drain()
                raise ReplicaFailed(
                    f"training timed out after {timeout:.0f} s (train_timeout_seconds); stopped {running}"
                )
            codes = {name: p.poll() for name, p in self.processes.items()}
            failed = [name for name, code in codes.items() if code is not None and (code != 0 or name in serving)]
            if failed:
                name = failed[0]
                tail = list(self._tails[name]) or ["(no output)"]
                if restartable(self.spec.restart_policy, codes[name]) and len(self.restarts) < self.spec.backoff_limit:
                    self._restart(name, codes[name], tail[-1])
                    continue
                self.stop()
                self._drain()
                raise ReplicaFailed(f"replica {name} exited with code {codes[name]}; last output: {' | '.join(tail)}")
            if all(codes[name] == 0 for name in codes if name not in serving):
                self.stop()
                self._drain()
                return codes
            time.sleep(0.2)

    def _restart(self, name: str, exit_code: int, cause: str) -> None:
        """restart_policy=on_failure. An async worker is restarted alone: the coordinator goes on with
        the others and the worker rejoins on its address. Anything else restarts the whole group
        (sync workers cannot go on without a peer; without its ps the chief fails): the replicas
        resume from the last checkpoint."""
        replica = next(r for r in self.layout.replicas if r.name == name)
        alone = replica.serves_until_stopped and replica.role == "worker"
        action = f"restarted {name}" if alone else "restarted every replica"
        self.restarts.append(
            {
                "replica": name,
                "exit_code": exit_code,
                "cause": cause,
                "action": action,
                "after_seconds": time.monotonic() - self._started_at,
            }
        )
        log.warning(
            "%s exited with code %s (%s): %s (%d of backoff_limit %d)",
            name,
            exit_code,
            cause,
            action,
            len(self.restarts),
            self.spec.backoff_limit,
        )
        RunPaths(self.run_dir).restarts.write_text(json.dumps(self.restarts, indent=2))
        if alone:
            self._start_replica(replica)
            return
        self.stop()
        self._drain()
        self.start()

    def _drain(self) -> None:
        for pump in self._pumps:
            pump.join(timeout=5)

    def stop(self) -> None:
        for throttle in self.throttles:  # a stopped process would not see SIGTERM
            throttle.stop()
        stop_process_groups([p.pid for p in self.processes.values()])


def stop_process_groups(pids: list[int], grace: float = _TERM_GRACE_SECONDS) -> list[int]:
    """SIGTERM each process group, then SIGKILL what is left after ``grace`` seconds.

    The escalation is needed: a TF worker waiting for a peer ignores SIGTERM (TF's preemption
    handler catches it). Returns the pids that were still alive.
    """
    alive = [pid for pid in pids if _signal_group(pid, signal.SIGTERM)]
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        _reap(alive)
        alive_now = [pid for pid in alive if _exists(pid)]
        if not alive_now:
            break
        time.sleep(0.1)
    for pid in alive:
        _signal_group(pid, signal.SIGKILL)
    _reap(alive)
    return alive


def _signal_group(pid: int, sig: int) -> bool:
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _reap(pids: list[int]) -> None:
    """Collect exit statuses of our own children so they do not linger as zombies."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def _run_environments(run_id: str) -> dict[int, list[bytes]]:
    """The environment of every live process that carries this run's id, by pid."""
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in environ:
            found[int(entry.name)] = environ
    return found


def run_processes(run_id: str) -> list[int]:
    """Pids of every live process that carries this run's id in its environment."""
    return list(_run_environments(run_id))


def run_replicas(run_id: str) -> dict[str, int]:
    """Pid of each live replica of the run, by name (``worker-1``), read from its TF_CONFIG."""
    replicas = {}
    for pid, environ in _run_environments(run_id).items():
        config = next((e for e in environ if e.startswith(b"TF_CONFIG=")), None)
        if config is not None:
            task = json.loads(config.split(b"=", 1)[1])["task"]
            replicas[f"{task['type']}-{task['index']}"] = pid
    return replicas


def teardown_run(run_id: str) -> list[int]:
    """End every process of the run, found by run id whatever started it. Returns the pids ended."""
    pids = run_processes(run_id)
    if pids:
        stop_process_groups(pids)
        for pid in pids:
            if _exists(pid):
                os.kill(pid, signal.SIGKILL)
    return pids

"""Local backend: every replica is a process on 127.0.0.1.

Each replica runs ``python -m tasks.replica`` with its own ``TF_CONFIG`` and ``HETFLOW_RUN_ID``,
in its own process group, under a keeper (``tasks.cluster.keeper``) that provisioning starts in a
session of its own: the replicas outlive the provisioning task and die when the supervising task
does. Their output goes to ``logs/<role>-<index>.log`` in the run directory; teardown finds every
process of a run by the run id in its environment.

TensorFlow's gRPC servers listen on every interface, unauthenticated. Run as root, provisioning
puts every keeper and replica of a run in a network namespace of the run's own with only loopback
up (``isolate_network``): they reach each other on its 127.0.0.1 and nothing outside it reaches
them. They stay in this PID namespace, so signals (throttling, stopping) work as before. Without
root or iproute2 they listen on this host's interfaces, and ``cluster.json`` says so.

Run as root, each keeper and replica also gets a mount namespace (``tasks.confine``): HETFLOW_HOME
shows only the run directory (read-write) and the prepared data (read-only), the user's home is
hidden, every other mount is
read-only, and the process has no capabilities; what a container of the docker backend mounts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tasks import confine
from tasks.cluster.layout import ClusterLayout, Replica, free_local_port
from tasks.cluster.supervisor import ReplicaState
from tasks.paths import REPO_ROOT, RunPaths, data_dir, hetflow_home, write_record
from tasks.spec import RunSpec

log = logging.getLogger("hetflow.cluster")

RUN_ID_ENV = "HETFLOW_RUN_ID"
TERM_GRACE_SECONDS = 10.0
NETNS_DIR = Path("/run/netns")  # where `ip netns` names namespaces


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
            if not signal_group(self.pid, signal.SIGSTOP):
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
            signal_group(self.pid, signal.SIGCONT)
            if stop_requested:
                break
        signal_group(self.pid, signal.SIGCONT)

    def _wait_until(self, deadline: float) -> bool:
        """Sleeps until ``deadline`` (monotonic); True when stop() was called meanwhile."""
        return self.done.wait(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=1)


def replica_view(spec: RunSpec, run_dir: Path, home: Path) -> dict[str, list[Path]]:
    """What of HETFLOW_HOME a replica sees, on every backend: its run directory, read-write, and the
    prepared data (the spec's data dir, or the one under ``home``), read-only."""
    return {"read_write": [run_dir], "read_only": [Path(spec.data_dir) if spec.data_dir else data_dir(home)]}


def isolate_files(spec: RunSpec, run_dir: Path) -> dict:
    """How the run's keepers and replicas see the file system: ``{"confined": true, "hidden": [...],
    "read_write": [...], "read_only": [...]}`` (see ``tasks.confine``), or ``{"confined": false,
    "reason": ...}`` (and a warning) where that takes what this process lacks."""
    reason = confine.unavailable()
    if reason:
        log.warning("replicas of %s see this host's whole file system as this user does (%s)", run_dir.name, reason)
        return {"confined": False, "reason": reason}
    view = replica_view(spec, run_dir, hetflow_home())
    hidden = [str(hetflow_home()), *confine.user_home()]
    return {"confined": True, "hidden": hidden, **{k: [str(p) for p in v] for k, v in view.items()}}


def port_taken(port: int) -> bool:
    """Whether something listens on ``port`` in this network namespace (on any interface: TF servers
    bind 0.0.0.0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def namespace_name(run_id: str, home: Path) -> str:
    """The run's network namespace: a hash of its HETFLOW_HOME and id (two homes may hold one id),
    20 characters, which `ip netns` takes as a file name."""
    return "hetflow-" + hashlib.sha256(f"{home}\0{run_id}".encode()).hexdigest()[:12]


def isolate_network(run_id: str) -> dict:
    """A fresh network namespace for the run's replicas, with only loopback up: ``{"isolated": true,
    "namespace": NAME}``; or ``{"isolated": false, "reason": ...}`` (and a warning) where none can be
    had: creating one takes root and iproute2."""
    ip, nsenter = shutil.which("ip"), shutil.which("nsenter")
    if os.geteuid() != 0:
        return _not_isolated(run_id, "not running as root, which `ip netns add` needs")
    if ip is None or nsenter is None:
        return _not_isolated(run_id, "no `ip` (iproute2) or `nsenter` (util-linux) command on PATH")
    name = namespace_name(run_id, hetflow_home())
    # One left by an earlier provisioning of the run goes: a fresh namespace has every port free.
    delete_namespace(name)
    for command in (["netns", "add", name], ["-n", name, "link", "set", "lo", "up"]):
        done = subprocess.run([ip, *command], capture_output=True, text=True)
        if done.returncode != 0:
            delete_namespace(name)
            return _not_isolated(run_id, f"`ip {' '.join(command)}` failed: {done.stderr.strip()}")
    log.info("replicas of %s run in network namespace %s, unreachable from outside it", run_id, name)
    return {"isolated": True, "namespace": name}


def _not_isolated(run_id: str, reason: str) -> dict:
    log.warning(
        "replicas of %s listen on every interface of this host, without authentication (%s): "
        "firewall their ports or use backend=docker",
        run_id,
        reason,
    )
    return {"isolated": False, "reason": reason}


def namespace_processes(name: str) -> list[int]:
    """Pids of every live process in the named network namespace (what `ip netns pids` lists)."""
    try:
        namespace = os.stat(NETNS_DIR / name)
    except OSError:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            net = os.stat(entry / "ns" / "net")
        except OSError:
            continue
        if (net.st_dev, net.st_ino) == (namespace.st_dev, namespace.st_ino):
            pids.append(int(entry.name))
    return pids


def delete_namespace(name: str) -> None:
    """Remove the namespace's name; the kernel frees it once no process is left in it."""
    if (NETNS_DIR / name).exists():
        done = subprocess.run(["ip", "netns", "delete", name], capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("could not delete network namespace %s: %s", name, done.stderr.strip())


class LocalReplicas:
    """The local backend's side of the supervision (``supervisor.Replicas``): starts each replica
    under a keeper (``tasks.cluster.keeper``), reads how it ended, stops it.

    :param probe: run the workers' speed probe (``tasks.replica --probe``) instead of training;
        their logs are ``logs/probe-<name>.log``.
    """

    restarts_in_place = False

    def __init__(self, layout: ClusterLayout, spec: RunSpec, run_dir: Path, probe: bool = False):
        self.layout = layout
        self.spec = spec
        self.run_dir = run_dir
        self.paths = RunPaths(run_dir)
        self.probe = probe
        self.cores = core_assignment(layout) if spec.pin_cores else {}
        self.gpus = visible_gpus(layout, spec)
        self._offsets: dict[str, int] = {}
        self._lease = None
        # Set by provision, else read from cluster.json.
        self.network_isolation: dict | None = None
        self.file_isolation: dict | None = None

    def log_path(self, name: str) -> Path:
        return self.paths.logs / f"{'probe-' if self.probe else ''}{name}.log"

    def provision(self) -> None:
        """Start every replica: in a network namespace of the run's own where one can be had, else
        on host ports still free. ``cluster.json`` records which (``network_isolation``)."""
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        self.paths.replicas.mkdir(parents=True, exist_ok=True)
        self.network_isolation = isolate_network(self.layout.run_id)
        self.file_isolation = isolate_files(self.spec, self.run_dir)
        if not self.network_isolation["isolated"]:
            self._move_off_taken_ports()
        if not self.probe:  # the probe's layout is not the run's
            write_record(
                self.paths.cluster,
                {
                    **self.layout.to_dict(),
                    "network_isolation": self.network_isolation,
                    "file_isolation": self.file_isolation,
                },
            )
        try:
            self.start(self.layout.replicas)
        except BaseException:
            teardown_run(self.layout.run_id)  # nothing half-started stays, the namespace included
            raise

    def _isolation(self) -> tuple[str | None, dict]:
        """The network namespace the run's replicas live in and how they see files: a restart comes
        from the supervising task, which did not provision, so it reads what provisioning recorded."""
        if self.network_isolation is None:
            record = json.loads(self.paths.cluster.read_text()) if self.paths.cluster.exists() else {}
            self.network_isolation = record.get("network_isolation", {"isolated": False})
            self.file_isolation = record.get("file_isolation", {"confined": False})
        return self.network_isolation.get("namespace"), self.file_isolation

    def _move_off_taken_ports(self) -> None:
        """Ports were picked free at planning; whatever took one since, the replica moves to
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
            write_record(self.paths.cluster, self.layout.to_dict())

    def start(self, replicas) -> None:
        for replica in replicas:
            self._start_keeper(replica)

    def _start_keeper(self, replica: Replica) -> None:
        from tasks.cluster.keeper import ATTACH_TIMEOUT_SECONDS, exit_path

        exit_path(self.run_dir, replica.name).unlink(missing_ok=True)
        log_path = self.log_path(replica.name)
        self._offsets[replica.name] = log_path.stat().st_size if log_path.exists() else 0
        slowdown = self.spec.worker_device(replica.index).slowdown if replica.role == "worker" else 1.0
        deadline = time.time() + ATTACH_TIMEOUT_SECONDS + self.spec.train_timeout_seconds
        command = [sys.executable, "-m", "tasks.cluster.keeper", "--run-dir", str(self.run_dir)]
        command += ["--name", replica.name, "--log-name", log_path.stem, "--deadline", repr(deadline)]
        command += ["--slowdown", repr(slowdown), *(["--probe"] if self.probe else [])]
        if replica.name in self.cores:
            command += ["--core", str(self.cores[replica.name])]
        namespace, files = self._isolation()
        if files["confined"]:
            command = confine.confined(command, files["hidden"], files["read_write"], files["read_only"])
        if namespace:
            # Only the network namespace changes (`ip netns exec` would also remount /sys); nsenter,
            # unshare and confine exec in place, so the pid recorded below is the keeper's.
            command = ["nsenter", f"--net={NETNS_DIR / namespace}", "--", *command]
        env = {
            **os.environ,
            **({"HOME": "/tmp"} if files["confined"] else {}),  # the real one is read-only there
            "TF_CONFIG": self.layout.tf_config(replica),
            RUN_ID_ENV: self.layout.run_id,
            "HETFLOW_LAUNCH_TIME": repr(time.time()),
            "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": self.gpus[replica.name],
        }
        with open(log_path, "ab") as keeper_errors:  # what the keeper itself says, if anything
            keeper = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=keeper_errors,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives this process: the next task supervises it
            )
        self._pid_path(replica.name).write_text(str(keeper.pid))
        notes = [f"in network namespace {namespace}"] if namespace else []
        if files["confined"]:
            notes.append("seeing only its run directory and the data")
        if replica.name in self.cores:
            notes.append(f"pinned to core {self.cores[replica.name]}")
        if slowdown > 1:
            notes.append(f"throttled to 1/{slowdown:g} of the CPU time (simulated slower machine)")
        log.info(
            "started %s (keeper pid %d) at %s%s",
            replica.name,
            keeper.pid,
            replica.address,
            "".join(f", {n}" for n in notes),
        )

    def _pid_path(self, name: str) -> Path:
        return self.paths.replicas / f"{'probe-' if self.probe else ''}{name}.pid"

    def _keeper(self, name: str) -> int:
        return int(self._pid_path(name).read_text())

    def attach(self) -> None:
        """Take the run's supervisor lease (see tasks.cluster.keeper): while this process holds
        it the replicas run; when it ends, however it ends, its keepers kill them."""
        from tasks.cluster.keeper import take_lease

        self._lease = take_lease(self.run_dir)

    def detach(self) -> None:
        if self._lease is not None:
            self._lease.close()
            self._lease = None

    def poll(self) -> dict[str, ReplicaState]:
        return {replica.name: self._state(replica.name) for replica in self.layout.replicas}

    def _state(self, name: str) -> ReplicaState:
        from tasks.cluster.keeper import exit_path

        record = exit_path(self.run_dir, name)
        if record.exists():
            return ReplicaState(json.loads(record.read_text())["exit_code"])
        if _running(self._keeper(name)):
            return ReplicaState(None)
        return ReplicaState(-signal.SIGKILL)  # the keeper was killed: its replica died with it

    def stop(self, names) -> None:
        """SIGTERM the keepers, which stop their replicas (SIGKILL after the grace period), all at
        once; a keeper still there after the grace is killed."""
        stop_process_groups([self._keeper(name) for name in names], grace=TERM_GRACE_SECONDS + 2)

    def lines(self, name: str, since: float):
        """Follow ``logs/<name>.log`` (the keeper writes it) from the replica's start, or from
        its last restart when ``since`` is set, until the replica has ended."""
        offset = self._offsets.get(name, 0) if since else 0
        with open(self.log_path(name), "rb") as log_file:
            log_file.seek(offset)
            pending = b""
            while True:
                chunk = log_file.read()
                if chunk:
                    pending += chunk
                    *complete, pending = pending.split(b"\n")
                    for raw in complete:
                        yield raw.decode("utf-8", "replace").rstrip()
                    continue
                if self._state(name).exit_code is not None:
                    if pending:
                        yield pending.decode("utf-8", "replace").rstrip()
                    return
                time.sleep(0.2)


def _running(pid: int) -> bool:
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
        alive_now = [pid for pid in alive if _running(pid)]
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
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5  # a SIGKILLed process takes a moment to leave
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
    for name in namespaces:
        delete_namespace(name)
    return pids

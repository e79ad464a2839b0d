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
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tasks import confine
from tasks.cluster.layout import ClusterLayout, Replica, free_local_port
from tasks.cluster.netns import NETNS_DIR, isolate_network
from tasks.cluster.processes import (
    RUN_ID_ENV,
    TERM_GRACE_SECONDS,
    is_running,
    stop_process_groups,
    teardown_run,
)
from tasks.cluster.supervisor import ReplicaState
from tasks.paths import REPO_ROOT, RunPaths, data_dir, hetflow_home, write_record
from tasks.spec import RunSpec

log = logging.getLogger("hetflow.cluster")


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
        if is_running(self._keeper(name)):
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

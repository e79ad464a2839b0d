"""Local backend: every replica is a process on 127.0.0.1.

Each replica runs ``python -m hetflow.replica`` with its own ``TF_CONFIG`` and ``HETFLOW_RUN_ID``,
in its own process group, under a keeper (``hetflow.cluster.backends.local.keeper``) that provisioning starts in a
session of its own: the replicas outlive the provisioning task and die when the supervising task
does. Their output goes to ``logs/<role>-<index>.log`` in the run directory; teardown finds every
process of a run by the run id in its environment.

Every keeper starts its replica sandboxed (``hetflow.sandbox``: bubblewrap, an unprivileged uid, no
capabilities): it sees its run directory read-only but for its output folder (``RunPaths.output``,
read-write), the prepared data (read-only), the code and the interpreter, and nothing else of this
host; it listens in the run's network namespace (``hetflow.cluster.backends.local.netns``), with only loopback
up, which the run's replicas share and nothing outside reaches (TensorFlow's gRPC servers listen
on every interface, unauthenticated). Where no sandbox can be had, provisioning refuses the run
unless the operator set ``HETFLOW_ALLOW_UNISOLATED=1``; then replicas listen on this host's ports,
and ``cluster.json`` says so.
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

from hetflow import sandbox
from hetflow.cluster import usage
from hetflow.cluster.backends.base import Replicas, ReplicaState
from hetflow.cluster.backends.local import netns
from hetflow.cluster.layout import ClusterLayout, Replica, core_assignment, free_local_port
from hetflow.cluster.output_lines import READ_SIZE, output_lines
from hetflow.cluster.processes import (
    RUN_ID_ENV,
    TERM_GRACE_SECONDS,
    is_running,
    run_processes,
    stop_process_groups,
    teardown_run,
)
from hetflow.cluster.replica_view import (
    hand_over_writable,
    provisioned_directories,
    remove_what_replicas_planted,
    replica_view,
)
from hetflow.paths import (
    REPO_ROOT,
    RunPaths,
    hetflow_home,
    write_record,
)
from hetflow.spec import RunSpec

log = logging.getLogger("hetflow.cluster")


def visible_gpus(layout: ClusterLayout, spec: RunSpec) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES per replica: each GPU worker gets its own GPUs, in worker order; CPU
    workers, the chief of parameter_server and the ps see none."""
    visible, next_gpu = {}, 0
    for replica in layout.replicas:
        device = spec.cluster.worker_device(replica.index) if replica.role == "worker" else None
        if device is not None and device.device == "gpu":
            visible[replica.name] = ",".join(str(next_gpu + i) for i in range(device.count))
            next_gpu += device.count
        else:
            visible[replica.name] = ""
    return visible


def file_view(spec: RunSpec, run_dir: Path) -> dict:
    """What a sandboxed replica sees of this host's files: ``{"confined": true, "hidden": [...],
    "read_write": [...], "read_only": [...]}`` (see ``hetflow.sandbox.Sandbox``)."""
    view = replica_view(spec, run_dir, hetflow_home())
    return {
        "confined": True,
        "hidden": sandbox.private_directories(),
        "read_write": [str(path) for path in view["read_write"]],
        "read_only": [str(path) for path in view["read_only"]],
    }


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


_HOLDER = "network"  # the name of the keeper of the run's network holder


class LocalReplicas(Replicas):
    """The local backend's side of the supervision (``supervisor.Replicas``): starts each replica
    under a keeper (``hetflow.cluster.backends.local.keeper``), reads how it ended, stops it."""

    restarts_in_place = False

    def __init__(self, layout: ClusterLayout, spec: RunSpec, run_dir: Path):
        self.layout = layout
        self.spec = spec
        self.run_dir = run_dir
        self.paths = RunPaths(run_dir)
        self.cores = core_assignment(layout) if spec.cluster.pin_cores else {}
        self.gpus = visible_gpus(layout, spec)
        self._offsets: dict[str, int] = {}
        self._lease = None
        # Decided here, never read back from the run directory: a restart comes from another task.
        self.sandboxed = sandbox.required(f"the replicas of {layout.run_id}")

    def usage_sampler(self):
        """Each replica's CPU and memory, from its process (``hetflow.cluster.usage``)."""
        return usage.LocalUsage(self.layout.run_id)

    def log_path(self, name: str) -> Path:
        folder = self.paths.replicas if name == _HOLDER else self.paths.logs  # as the keeper writes it
        return folder / f"{name}.log"

    def provision(self) -> None:
        """Start the run's network holder, then every replica in its namespace; where the run is
        unisolated (see the module), every replica on host ports still free. ``cluster.json`` records
        which (``network_isolation``, ``file_isolation``)."""
        remove_what_replicas_planted(self.run_dir)  # an earlier try's, which no detach cleaned
        for directory in provisioned_directories(self.paths):
            directory.mkdir(parents=True, exist_ok=True)
        if self.sandboxed:
            network = {"isolated": True, "sandbox": "bubblewrap"}
            files = file_view(self.spec, self.run_dir)
            hand_over_writable(self.paths, sandbox.run_owner(self.run_dir))
        else:
            reason = sandbox.unavailable()
            network = {"isolated": False, "reason": reason}
            files = {"confined": False, "reason": reason}
            self._move_off_taken_ports()
        write_record(
            self.paths.cluster, {**self.layout.to_dict(), "network_isolation": network, "file_isolation": files}
        )
        try:
            if self.sandboxed:
                self._start_keeper(None)
            self.start(self.layout.replicas)
        except BaseException:
            teardown_run(self.layout.run_id)  # nothing half-started stays
            raise

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

    def _start_keeper(self, replica: Replica | None) -> None:
        """Start the keeper of ``replica``, or of the run's network holder (None)."""
        from hetflow.cluster.backends.local.keeper import exit_path
        from hetflow.cluster.lease import ATTACH_TIMEOUT_SECONDS

        name = replica.name if replica else _HOLDER
        exit_path(self.run_dir, name).unlink(missing_ok=True)
        log_path = self.log_path(name)
        self._offsets[name] = log_path.stat().st_size if log_path.exists() else 0
        deadline = time.time() + ATTACH_TIMEOUT_SECONDS + self.spec.cluster.run_policy.timeout_seconds
        command = [sys.executable, "-m", "hetflow.cluster.backends.local.keeper", "--run-dir", str(self.run_dir)]
        command += ["--name", name, "--deadline", repr(deadline)]
        env = {
            **os.environ,
            "HETFLOW_HOME": str(hetflow_home()),  # teardown matches a run's processes by id and home
            RUN_ID_ENV: self.layout.run_id,
            "PYTHONUNBUFFERED": "1",
        }
        notes = []
        if replica is None:
            command += ["--network-holder"]
            netns.record_path(self.run_dir).unlink(missing_ok=True)
        else:
            slowdown = self.spec.cluster.worker_device(replica.index).slowdown if replica.role == "worker" else 1.0
            command += ["--slowdown", repr(slowdown), "--memory-mb", str(self.spec.cluster.resources.memory_mb)]
            if replica.name in self.cores:
                command += ["--core", str(self.cores[replica.name])]
                notes.append(f"pinned to core {self.cores[replica.name]}")
            if slowdown > 1:
                notes.append(f"throttled to 1/{slowdown:g} of the CPU time (simulated slower machine)")
            env.update(
                TF_CONFIG=self.layout.tf_config(replica),
                HETFLOW_LAUNCH_TIME=repr(time.time()),
                CUDA_VISIBLE_DEVICES=self.gpus[replica.name],
            )
        if self.sandboxed:
            view = file_view(self.spec, self.run_dir)
            command += [f"--{flag}={path}" for flag, key in self._VIEW_FLAGS for path in view[key]]
            notes.insert(0, "sandboxed in the run's network namespace")
        else:
            command += ["--unisolated"]
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
        self._pid_path(name).write_text(str(keeper.pid))
        if replica is None:
            self._wait_for_network(keeper)
            log.info("the network holder of %s runs (keeper pid %d)", self.layout.run_id, keeper.pid)
            return
        log.info(
            "started %s (keeper pid %d) at %s%s", name, keeper.pid, replica.address, "".join(f", {n}" for n in notes)
        )

    _VIEW_FLAGS = (("rw", "read_write"), ("ro", "read_only"), ("hide", "hidden"))

    def _wait_for_network(self, keeper: subprocess.Popen) -> None:
        """Until the holder's record is there: the replicas join what it names."""
        record = netns.record_path(self.run_dir)
        deadline = time.monotonic() + netns.HOLDER_START_SECONDS
        while not record.exists():
            if keeper.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path(_HOLDER).read_text(errors="replace")
                raise netns.NetworkGone(f"the run's network namespace could not be made: {tail.strip()[-500:]}")
            time.sleep(0.05)

    def _pid_path(self, name: str) -> Path:
        return self.paths.replicas / f"{name}.pid"

    def _keeper(self, name: str) -> int:
        return int(self._pid_path(name).read_text())

    def attach(self) -> None:
        """Take the run's supervisor lease (see hetflow.cluster.backends.local.keeper): while this process holds
        it the replicas run; when it ends, however it ends, its keepers kill them."""
        from hetflow.cluster.lease import take_lease

        self._lease = take_lease(self.run_dir)

    def detach(self) -> None:
        """Give the lease back, stop what is left of the run (the keepers would end their replicas
        anyway, and the network holder only they used), and remove what the replicas planted."""
        if self._lease is not None:
            self._lease.close()
            self._lease = None
            names = [replica.name for replica in self.layout.replicas] + ([_HOLDER] if self.sandboxed else [])
            ours = set(run_processes(self.layout.run_id))  # a recorded pid may since be another process's
            keepers = [self._keeper(name) for name in names if self._pid_path(name).exists()]
            stop_process_groups([pid for pid in keepers if pid in ours], grace=TERM_GRACE_SECONDS + 2)
            remove_what_replicas_planted(self.run_dir)  # none is left to plant more

    def poll(self) -> dict[str, ReplicaState]:
        return {replica.name: self._state(replica.name) for replica in self.layout.replicas}

    def _state(self, name: str) -> ReplicaState:
        from hetflow.cluster.backends.local.keeper import exit_path

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
            yield from output_lines(self._appended(name, log_file))

    def _appended(self, name: str, log_file):
        """What the replica appends to its log, a bounded read at a time, until it has ended."""
        while True:
            chunk = log_file.read(READ_SIZE)
            if chunk:
                yield chunk
                continue
            if self._state(name).exit_code is not None:
                return
            time.sleep(0.2)

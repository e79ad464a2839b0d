"""The swarm backend's services: what each replica's service and the run's overlay network are
(``service_config``, ``network_config``, placed by ``placement``), and ``SwarmReplicas``, which
creates, watches and removes them for the supervisor. The backend as a whole is described in
``hetflow.cluster.backends.swarm.backend``."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import docker
from docker.types import EndpointSpec, Mount, Resources, RestartPolicy, ServiceMode

from hetflow.cluster.backends.base import ReplicaState
from hetflow.cluster.containers import (
    PIDS_LIMIT,
    STOP_GRACE_SECONDS,
    TMP_BYTES,
    ReplicaLaunch,
    open_log,
    replica_environment,
    replica_spec,
)
from hetflow.cluster.engine import LABEL_INDEX, LABEL_ROLE, EngineReplicas, container_name, network_name, run_labels
from hetflow.cluster.layout import ClusterLayout, Replica, plan_named_cluster
from hetflow.cluster.lease import ATTACH_TIMEOUT_SECONDS
from hetflow.cluster.output_lines import cut_lines
from hetflow.cluster.replica_view import replica_view
from hetflow.paths import RunPaths, write_record
from hetflow.spec import RunSpec

log = logging.getLogger("hetflow.cluster")

LABEL_DEVICE = "hetflow.device"  # a node's device kind: gpu or cpu (docker node update --label-add)
GPU_RESOURCE = "NVIDIA-GPU"  # the generic resource a GPU node advertises (dockerd's node-generic-resources)
# Task states after which the task will never run (again).
ENDED = ("complete", "failed", "rejected", "shutdown", "orphaned", "remove")


def plan(spec: RunSpec, run_id: str) -> ClusterLayout:
    # A service's name is its DNS name on the run's network, wherever its task is placed.
    return plan_named_cluster(spec, run_id, lambda name: container_name(run_id, name))


def placement(spec: RunSpec, replica: Replica) -> list[str]:
    """The replica's placement constraints: workers by their device's node label or their named
    node; the chief and the ps anywhere."""
    if replica.role != "worker":
        return []
    needs = replica_spec(spec, replica)
    if needs.node:
        return [f"node.hostname=={needs.node}"]
    if needs.device == "gpu":
        return [f"node.labels.{LABEL_DEVICE}==gpu"]
    return [f"node.labels.{LABEL_DEVICE}!=gpu"]  # unlabelled nodes qualify


def network_config(run_id: str, run_dir: Path, encrypted: bool) -> dict:
    """Keyword arguments of ``client.networks.create``: an overlay of the run's own; ``internal``
    keeps the replicas' unauthenticated gRPC servers from being reachable from outside the run."""
    return {
        "name": network_name(run_id),
        "driver": "overlay",
        "attachable": True,
        "internal": True,
        "options": {"encrypted": "true"} if encrypted else {},
        "labels": run_labels(run_id, run_dir),
    }


def service_config(launch: ReplicaLaunch) -> dict:
    """Keyword arguments of ``client.services.create`` for one replica, hardened as its
    container is: no capabilities, a read-only root file system with a private /tmp, a bounded
    process count (``Limits.Pids``, API 1.41: Docker 20.10), and no privilege to gain, which a service
    cannot ask of Docker 20.10 (``Privileges.NoNewPrivileges`` came with a later API): ``setpriv
    --no-new-privs`` sets the same kernel flag on the replica's first process, and every process it
    starts inherits it."""
    layout, replica, spec, home, run_dir, user, launched_at = launch
    view = replica_view(spec, run_dir, home)
    deadline = ATTACH_TIMEOUT_SECONDS + spec.cluster.run_policy.timeout_seconds
    # Before its deadline a replica ends once its supervisor's heartbeat stops; not on the lease,
    # whose flock over the nodes' shared storage (NFS) can read as released while it is held
    # (hetflow.cluster.lease).
    environment = {**replica_environment(layout, replica, home, launched_at), "HOME": "/tmp"}
    needs = replica_spec(spec, replica)
    cpus, memory, gpus = needs.cpus, needs.memory_mb * 2**20, needs.gpus
    return {
        "image": needs.image,
        "command": ["setpriv", "--no-new-privs", "timeout", f"--kill-after={STOP_GRACE_SECONDS}", f"{deadline:.0f}"]
        + ["python", "-m", "hetflow.replica"],
        "args": ["--run-dir", str(run_dir), "--watch-supervisor", "heartbeat"],
        "name": container_name(layout.run_id, replica.name),
        "hostname": container_name(layout.run_id, replica.name),
        "user": user,
        "env": [f"{key}={value}" for key, value in environment.items()],
        "labels": {**run_labels(layout.run_id, run_dir), LABEL_ROLE: replica.role, LABEL_INDEX: str(replica.index)},
        "networks": [network_name(layout.run_id)],
        "mounts": [Mount(str(p), str(p), type="bind") for p in view["read_write"]]
        + [Mount(str(p), str(p), type="bind", read_only=True) for p in view["read_only"]]
        + [Mount("/tmp", None, type="tmpfs", tmpfs_size=TMP_BYTES)],
        "cap_drop": ["ALL"],
        "read_only": True,
        "endpoint_spec": EndpointSpec(mode="dnsrr"),
        "restart_policy": RestartPolicy(condition="none"),
        "constraints": placement(spec, replica),
        "resources": _resources(cpus, memory, gpus),
        "stop_grace_period": STOP_GRACE_SECONDS * 10**9,
        "mode": ServiceMode("replicated", replicas=1),
    }


def _resources(cpus: float, memory: int, gpus: int) -> Resources:
    """Limits and reservations; the pids limit, which docker's SDK has no argument for, by its key."""
    resources = Resources(
        cpu_limit=round(cpus * 1e9) or None,
        cpu_reservation=round(cpus * 1e9) or None,
        mem_limit=memory or None,
        mem_reservation=memory or None,
        generic_resources={GPU_RESOURCE: gpus} if gpus else None,
    )
    resources.setdefault("Limits", {})["Pids"] = PIDS_LIMIT
    return resources


def newest_task(client, service_name: str) -> dict | None:
    tasks = client.api.tasks(filters={"service": service_name})
    return max(tasks, key=lambda t: (t["Version"]["Index"], t["CreatedAt"])) if tasks else None


def task_state(task: dict | None) -> ReplicaState:
    """A replica's state from its service's newest task: running until the task ends; a task the
    swarm rejected (no such image, a mount source missing on the node) never will."""
    if task is None:
        return ReplicaState()
    status = task["Status"]
    state = status["State"]
    if state not in ENDED:
        return ReplicaState()
    if state == "rejected":
        return ReplicaState(None, stuck=status.get("Err") or "rejected by the swarm")
    exit_code = (status.get("ContainerStatus") or {}).get("ExitCode")
    if state == "complete":
        return ReplicaState(0)
    if state == "orphaned" or exit_code is None:
        return ReplicaState(-9)  # lost with its node: as if killed
    return ReplicaState(exit_code)


class SwarmReplicas(EngineReplicas):
    """The swarm backend's side of the supervision (``supervisor.Replicas``): creates, inspects and
    removes the services of one run."""

    def __init__(self, layout: ClusterLayout, spec: RunSpec, run_dir: Path, client=None):
        super().__init__(layout, spec, run_dir, client)
        self.nodes: dict[str, str] = {}  # replica: the id of the node its newest task runs on

    def provision(self) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.client.networks.create(
            **network_config(self.layout.run_id, self.run_dir, self.spec.cluster.swarm.encrypt_network)
        )
        self.start(self.layout.replicas)

    def configure(self, replica: Replica, home: Path, user: str, launched_at: float) -> dict:
        return service_config(ReplicaLaunch(self.layout, replica, self.spec, home, self.run_dir, user, launched_at))

    def remove_named(self, name: str) -> None:
        self.client.services.get(name).remove()

    def create(self, replica: Replica, config: dict) -> None:
        service = self.client.services.create(**config)
        log.info("created %s (service %s) at %s", replica.name, service.short_id, replica.address)

    def _node_name(self, node_id: str) -> str:
        try:
            return self.client.nodes.get(node_id).attrs["Description"]["Hostname"]
        except docker.errors.NotFound:
            return node_id

    def poll(self) -> dict[str, ReplicaState]:
        nodes = {node.id: node.attrs for node in self.client.nodes.list()}
        return {replica.name: self._state(replica.name, nodes) for replica in self.layout.replicas}

    def _state(self, name: str, nodes: dict[str, dict], record_node: bool = True) -> ReplicaState:
        service_name = container_name(self.layout.run_id, name)
        try:
            self.client.services.get(service_name)
        except docker.errors.NotFound:  # removed by someone else: gone with its exit code
            return ReplicaState(-1)
        task = newest_task(self.client, service_name)
        state = task_state(task)
        node = nodes.get(task.get("NodeID")) if task else None
        if record_node and node and self.nodes.get(name) != task["NodeID"]:
            self._placed(name, task["NodeID"])
        if node and node["Status"]["State"] == "down" and state.exit_code is None:
            # Swarm marks the node down within seconds, but the task stays "running": it is lost.
            return ReplicaState(-9, note=f"its node {node['Description']['Hostname']} went down")
        return state

    def _placed(self, replica_name: str, node_id: str) -> None:
        """Record which node runs the replica (``replicas/nodes.json``: replica -> node hostname)."""
        self.nodes[replica_name] = node_id
        node = self._node_name(node_id)
        log.info("%s runs on node %s", replica_name, node)
        placed = {name: self._node_name(node_id) for name, node_id in self.nodes.items()}
        write_record(RunPaths(self.run_dir).nodes, placed)

    def stop(self, names) -> None:
        """Scale the services to nothing: their tasks get SIGTERM, then SIGKILL after the grace."""
        for name in names:
            try:
                self.client.services.get(container_name(self.layout.run_id, name)).scale(0)
            except docker.errors.NotFound:
                pass

    def lines(self, name: str, since: float):
        """The service's output, read every half second until its task has ended or its node went
        down (a service's log stream does not end by itself); kept in ``logs/<name>.log``."""
        service_name = container_name(self.layout.run_id, name)
        log_path = self.logs_dir / f"{name}.log"
        last = ""  # the newest line read, by its time stamp
        with open_log(log_path) as log_file:
            while True:
                try:
                    service = self.client.services.get(service_name)
                    nodes = {node.id: node.attrs for node in self.client.nodes.list()}
                    ended = self._state(name, nodes, record_node=False).exit_code is not None
                    newest = _stamp_seconds(last) if last else since
                    raw = b"".join(cut_lines(service.logs(stdout=True, stderr=True, timestamps=True, since=newest)))
                except docker.errors.NotFound:
                    return
                for entry in raw.decode("utf-8", "replace").splitlines():
                    stamp, _, line = entry.partition(" ")
                    key = _stamp_key(stamp)
                    if key is None:  # the engine's own message (a node it cannot reach), not output
                        log.debug("%s: %s", name, entry)
                        continue
                    if key <= last:  # read already
                        continue
                    last = key
                    log_file.write(line + "\n")
                    log_file.flush()
                    yield line
                if ended:
                    return
                time.sleep(0.5)


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z$")


def _stamp_key(stamp: str) -> str | None:
    """Docker's RFC 3339 time stamp, its fraction padded to nanoseconds so that keys sort as times
    (Docker drops trailing zeros); None for anything else."""
    match = _STAMP.match(stamp)
    return f"{match[1]}.{(match[2] or '').ljust(9, '0')}" if match else None


def _stamp_seconds(key: str) -> int:
    """The whole second of a ``_stamp_key``: what ``since`` takes (the lines of that second are read
    again and skipped by key)."""
    from datetime import datetime, timezone

    return int(datetime.strptime(key[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp())

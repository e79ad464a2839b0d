"""Swarm backend: one Docker Swarm service (one task) per replica, spread over the swarm's nodes.

hetflow talks to a manager's engine (``DOCKER_HOST``). Every replica's service runs the replica
image's entry point with the same TF_CONFIG as on every backend; peers are addressed by service
name, which the swarm's DNS resolves to the service's task wherever it runs and after it is placed
again (``endpoint_mode=dnsrr``: virtual IPs need IPVS, which not every node has). The services sit on
an attachable, internal overlay network of the run's own (``network_config``), so no replica is
reachable from outside the run, encrypted between nodes unless ``encrypt_network=false`` (preflight
refuses encryption where a node's kernel says it has no IPsec ESP).

Placement is from node labels: a worker with ``device=gpu`` goes to a node labelled
``hetflow.device=gpu``; a CPU worker to any node not labelled so; ``worker_devices[i].node`` names its
node. Resources are Swarm limits and reservations; GPUs are generic resources (``NVIDIA-GPU``).
Swarm never restarts a replica by itself (restart condition ``none``): the one supervisor
(``hetflow.cluster.supervisor``) decides, as on every backend. Every service and network carries the
run's labels, so teardown and ``hetflow sweep`` find them.

The run directory and the prepared data are bind-mounted at the same paths as on the supervisor,
so HETFLOW_HOME must be on storage that every node mounts at that path (NFS, say); ``preflight``
checks, on every node the run may use, that the path is there and the replica image is the one
built from this checkout.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from pathlib import Path
from typing import Sequence

import docker
from docker.types import EndpointSpec, Mount, Resources, RestartPolicy, ServiceMode

from hetflow.cluster.containers import (
    STOP_GRACE_SECONDS,
    container_user,
    open_log,
    prepare_run_dir,
    replica_environment,
    replica_spec,
)
from hetflow.cluster.docker_backend import (
    LABEL_INDEX,
    LABEL_ROLE,
    LABEL_RUN,
    LABEL_RUN_DIR,
    LABEL_RUN_ID,
    container_name,
    network_name,
    run_filter,
    run_labels,
    source_digest,
)
from hetflow.cluster.layout import ClusterLayout, Replica, plan_named_cluster
from hetflow.cluster.lease import ATTACH_TIMEOUT_SECONDS, take_lease
from hetflow.cluster.local import replica_view
from hetflow.cluster.supervisor import ReplicaState
from hetflow.paths import RunPaths, hetflow_home, run_paths, write_record
from hetflow.spec import RunSpec

log = logging.getLogger("hetflow.cluster")

LABEL_DEVICE = "hetflow.device"  # a node's device kind: gpu or cpu (docker node update --label-add)
LABEL_CHECK = "hetflow.check"  # preflight's one-shot services
GPU_RESOURCE = "NVIDIA-GPU"  # the generic resource a GPU node advertises (dockerd's node-generic-resources)
# Task states after which the task will never run (again).
_ENDED = ("complete", "failed", "rejected", "shutdown", "orphaned", "remove")
CHECK_TIMEOUT_SECONDS = 120.0
# Whether the node's kernel can do IPsec ESP, which an encrypted overlay needs: without it the
# network is created and then drops every packet between nodes (seen here: CONFIG_INET_ESP unset).
# Kernels that do not publish their configuration say nothing, and the run goes ahead.
_ESP_CHECK = (
    "if [ -r /proc/config.gz ]; then "
    "if zcat /proc/config.gz | grep -qE '^CONFIG_INET_ESP=(y|m)'; then echo esp=yes; else echo esp=no; fi; fi"
)


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


def satisfies(node: dict, constraints: list[str]) -> bool:
    """Whether a node (``docker node inspect``'s attributes) meets constraints made by ``placement``."""
    labels = node["Spec"].get("Labels") or {}
    for constraint in constraints:
        negated = "!=" in constraint
        key, value = constraint.split("!=" if negated else "==", 1)
        if key == "node.hostname":
            actual = node["Description"]["Hostname"]
        else:
            actual = labels.get(key.removeprefix("node.labels."))
        if (actual == value) == negated:
            return False
    return True


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


def service_config(
    layout: ClusterLayout,
    replica: Replica,
    spec: RunSpec,
    home: Path,
    run_dir: Path,
    user: str,
    launched_at: float,
    protected: Sequence[Path] = (),
) -> dict:
    """Keyword arguments of ``client.services.create`` for one replica (see the docker backend's
    ``container_config`` for what the parameters mean: the replica is the same): no capabilities,
    a read-only root file system with a private /tmp. (Swarm services of Docker 20.10 take no
    no-new-privileges flag nor a pids limit; a uid without capabilities has nothing to gain.)"""
    view = replica_view(spec, run_dir, home)
    deadline = ATTACH_TIMEOUT_SECONDS + spec.train_timeout_seconds
    # Before its deadline a replica ends once its supervisor's heartbeat stops; not on the lease,
    # whose flock over the nodes' shared storage (NFS) can read as released while it is held
    # (hetflow.cluster.lease).
    environment = {**replica_environment(layout, replica, home, launched_at), "HOME": "/tmp"}
    needs = replica_spec(spec, replica)
    cpus, memory, gpus = needs.cpus, needs.memory_mb * 2**20, needs.gpus
    return {
        "image": needs.image,
        "command": ["timeout", f"--kill-after={STOP_GRACE_SECONDS}", f"{deadline:.0f}"]
        + ["python", "-m", "hetflow.replica"],
        "args": ["--run-dir", str(run_dir), "--watch-supervisor", "heartbeat"],
        "name": container_name(layout.run_id, replica.name),
        "hostname": container_name(layout.run_id, replica.name),
        "user": user,
        "env": [f"{key}={value}" for key, value in environment.items()],
        "labels": {**run_labels(layout.run_id, run_dir), LABEL_ROLE: replica.role, LABEL_INDEX: str(replica.index)},
        "networks": [network_name(layout.run_id)],
        "mounts": [Mount(str(p), str(p), type="bind") for p in view["read_write"]]
        + [Mount(str(p), str(p), type="bind", read_only=True) for p in [*view["read_only"], *protected]]
        + [Mount("/tmp", None, type="tmpfs")],
        "cap_drop": ["ALL"],
        "read_only": True,
        "endpoint_spec": EndpointSpec(mode="dnsrr"),
        "restart_policy": RestartPolicy(condition="none"),
        "constraints": placement(spec, replica),
        "resources": Resources(
            cpu_limit=round(cpus * 1e9) or None,
            cpu_reservation=round(cpus * 1e9) or None,
            mem_limit=memory or None,
            mem_reservation=memory or None,
            generic_resources={GPU_RESOURCE: gpus} if gpus else None,
        ),
        "stop_grace_period": STOP_GRACE_SECONDS * 10**9,
        "mode": ServiceMode("replicated", replicas=1),
    }


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
    if state not in _ENDED:
        return ReplicaState()
    if state == "rejected":
        return ReplicaState(None, stuck=status.get("Err") or "rejected by the swarm")
    exit_code = (status.get("ContainerStatus") or {}).get("ExitCode")
    if state == "complete":
        return ReplicaState(0)
    if state == "orphaned" or exit_code is None:
        return ReplicaState(-9)  # lost with its node: as if killed
    return ReplicaState(exit_code)


class SwarmReplicas:
    """The swarm backend's side of the supervision (``supervisor.Replicas``): creates, inspects and
    removes the services of one run."""

    restarts_in_place = False

    def __init__(self, layout: ClusterLayout, spec: RunSpec, run_dir: Path, client=None):
        self.layout = layout
        self.spec = spec
        self.run_dir = run_dir
        self.logs_dir = run_dir / "logs"
        self.client = client or docker.from_env()
        self.nodes: dict[str, str] = {}  # replica: the id of the node its newest task runs on

    def provision(self) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.client.networks.create(**network_config(self.layout.run_id, self.run_dir, self.spec.encrypt_network))
        self.start(self.layout.replicas)

    def start(self, replicas) -> None:
        protected = prepare_run_dir(RunPaths(self.run_dir))
        launched_at = time.time()
        for replica in replicas:
            config = service_config(
                self.layout,
                replica,
                self.spec,
                hetflow_home(),
                self.run_dir,
                container_user(),
                launched_at,
                protected,
            )
            try:  # a restart: the service whose task ended gives way to a new one of the same name
                self.client.services.get(config["name"]).remove()
            except docker.errors.NotFound:
                pass
            service = self.client.services.create(**config)
            log.info("created %s (service %s) at %s", replica.name, service.short_id, replica.address)

    def attach(self) -> None:
        """Hold the run's lease and beat its heartbeat: the services' replicas end themselves once
        it stops (``hetflow.cluster.lease``), and `hetflow sweep` leaves a supervised run alone."""
        self._lease = take_lease(self.run_dir, heartbeat=True)

    def detach(self) -> None:
        self._lease.close()

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
        """Record which node runs the replica (``nodes.json``: replica -> node hostname)."""
        self.nodes[replica_name] = node_id
        node = self._node_name(node_id)
        log.info("%s runs on node %s", replica_name, node)
        placed = {name: self._node_name(node_id) for name, node_id in self.nodes.items()}
        write_record(self.run_dir / "nodes.json", placed)

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
                    raw = b"".join(service.logs(stdout=True, stderr=True, timestamps=True, since=newest))
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


def check_nodes(client, spec: RunSpec, run_id: str, nodes: list[dict], home: Path) -> list[str]:
    """On each node, a one-shot service of the replica image that reads a file just written under
    HETFLOW_HOME, prints the image's source digest and whether the kernel has IPsec ESP: one line
    for each node without the image, with another code's image, without the shared path, or (with
    ``encrypt_network``) whose kernel says it cannot encrypt."""
    token = secrets.token_hex(8)
    marker = home / ".swarm-check" / token
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(token)
    # The run's labels, with the directory the run will have: an interrupted check is swept as its run.
    labels = {**run_labels(run_id, run_paths(run_id).root), LABEL_CHECK: token}
    services = {}
    try:
        for node in nodes:
            hostname = node["Description"]["Hostname"]
            services[hostname] = client.services.create(
                spec.image,
                command=["sh", "-c", f'echo "digest=$HETFLOW_SOURCE_DIGEST"; {_ESP_CHECK}; cat {marker}'],
                name=f"hetflow-check-{token}-{node['ID'][:12]}",
                labels=labels,
                user=container_user(),
                # The marker's folder alone: as the replicas, the check sees only what it is shown.
                mounts=[Mount(str(marker.parent), str(marker.parent), type="bind", read_only=True)],
                restart_policy=RestartPolicy(condition="none"),
                constraints=[f"node.id=={node['ID']}"],
                mode=ServiceMode("replicated", replicas=1),
            )
        deadline = time.monotonic() + CHECK_TIMEOUT_SECONDS
        results = {}
        while len(results) < len(services) and time.monotonic() < deadline:
            for hostname, service in services.items():
                task = newest_task(client, service.name)
                if hostname not in results and task and task["Status"]["State"] in _ENDED:
                    results[hostname] = (task, b"".join(service.logs(stdout=True, stderr=True)).decode())
            time.sleep(0.3)
        return [_node_problem(hostname, spec, token, home, *results.get(hostname, (None, ""))) for hostname in services]
    finally:
        for service in services.values():
            service.remove()
        marker.unlink(missing_ok=True)


def _node_problem(hostname: str, spec: RunSpec, token: str, home: Path, task: dict | None, output: str) -> str:
    if task is None:
        return f"node {hostname}: its check did not finish within {CHECK_TIMEOUT_SECONDS:.0f} s"
    error = task["Status"].get("Err") or ""
    if "No such image" in error or "image" in error.lower() and "not" in error.lower():
        return (
            f"node {hostname} does not have image={spec.image}: load it there (docker save | docker load) "
            "or push it to a registry the nodes pull from"
        )
    if "bind source path does not exist" in error or "mount" in error.lower():
        return f"node {hostname} does not mount HETFLOW_HOME={home}: mount the shared storage there at the same path"
    if error:
        return f"node {hostname}: the image check failed: {error}"
    digest = next((line[len("digest=") :] for line in output.splitlines() if line.startswith("digest=")), "")
    if digest != source_digest():
        return (
            f"node {hostname} has image={spec.image} built from other code than this checkout (source digest "
            f"{digest[:12] or 'none'}, checkout {source_digest()[:12]}): rebuild it (make image) and load it there"
        )
    if spec.encrypt_network and "esp=no" in output.splitlines():
        return (
            f"node {hostname}: its kernel has no IPsec ESP (CONFIG_INET_ESP), so encrypt_network=true cannot carry "
            "traffic between the nodes: set encrypt_network=false where the nodes share a private network"
        )
    if token not in output:
        return f"node {hostname} sees another HETFLOW_HOME={home} than this one: mount the same shared storage there"
    return ""


def preflight(spec: RunSpec, run_id: str, client=None) -> list[str]:
    """What would stop the run's services from starting, one line each, before anything starts:
    no swarm, not a manager, a placement no node satisfies, a node without the image of this code
    or without the shared HETFLOW_HOME."""
    try:
        client = client or docker.from_env()
        info = client.info()
    except docker.errors.DockerException as error:
        reason = str(error).splitlines()[0][:200]
        return [f"backend=swarm: no Docker engine answers ({reason}); set DOCKER_HOST to a swarm manager's engine"]
    swarm = info.get("Swarm") or {}
    if swarm.get("LocalNodeState") != "active":
        return [
            f"backend=swarm: the Docker engine of {info.get('Name')} is not in a swarm: run `docker swarm init` on "
            "it and `docker swarm join` on the other machines, or use backend=docker"
        ]
    if not swarm.get("ControlAvailable"):
        return [
            f"backend=swarm: {info.get('Name')} is a swarm worker, not a manager: point DOCKER_HOST at a manager's "
            "engine (`docker node ls` on a manager lists them)"
        ]
    problems = []
    taken = client.services.list(filters=run_filter(run_id))
    if taken:
        problems.append(
            f"run {run_id} already has services on the swarm ({', '.join(sorted(s.name for s in taken))}): a run "
            "with this id is running or was not torn down; use another run id, or tear it down"
        )
    ready = [
        node.attrs
        for node in client.nodes.list()
        if node.attrs["Status"]["State"] == "ready" and node.attrs["Spec"]["Availability"] == "active"
    ]
    names = ", ".join(sorted(n["Description"]["Hostname"] for n in ready))
    used: dict[str, dict] = {}
    for replica in plan(spec, run_id).replicas:
        constraints = placement(spec, replica)
        fitting = [node for node in ready if satisfies(node, constraints)]
        if not fitting:
            device = spec.worker_device(replica.index)
            key = f"worker_devices[{replica.index}]"
            wanted = f"{key}.node={device.node}" if device.node else f"{key}.device={device.device}"
            problems.append(
                f"{wanted}: no ready, active node of the swarm fits {' and '.join(constraints)} (nodes: {names}); "
                f"label one (docker node update --label-add {LABEL_DEVICE}=...) or change the spec"
            )
        used.update({node["ID"]: node for node in fitting})
    if used and not problems:
        problems += [line for line in check_nodes(client, spec, run_id, list(used.values()), hetflow_home()) if line]
    return problems


def teardown_run(run_id: str, client=None) -> list[str]:
    """Remove every service of the run (their tasks stop), then its network, found by label.
    Returns the names of the services removed."""
    client = client or docker.from_env()
    selector = run_filter(run_id)
    services = client.services.list(filters=selector)
    for service in services:
        try:
            service.remove()
        except docker.errors.NotFound:  # removed meanwhile (a concurrent teardown)
            pass
    _remove_networks(client, client.networks.list(filters=selector))
    return [s.name for s in services]


def _remove_networks(client, networks) -> None:
    """A network is removable once the tasks of the removed services have left it (a few seconds)."""
    deadline = time.monotonic() + 30
    for network in networks:
        while True:
            try:
                network.remove()
                break
            except docker.errors.NotFound:
                break
            except docker.errors.APIError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def sweep_services(home: Path, attach_seconds: float) -> dict[str, list[str]]:
    """Remove the services and overlay networks of this home's runs that no supervisor holds.
    Nothing to do where the engine is not a swarm manager."""
    from hetflow.cluster.sweep import docker_time, run_is_live

    try:
        client = docker.from_env()
        services = client.services.list(filters={"label": LABEL_RUN})
    except docker.errors.DockerException:  # no engine, or not a swarm manager
        return {"services": []}
    runs: dict[str, tuple[str, float]] = {}
    for service in services:
        labels = service.attrs["Spec"].get("Labels") or {}
        run_dir, newest = runs.get(labels[LABEL_RUN_ID], (labels[LABEL_RUN_DIR], 0.0))
        runs[labels[LABEL_RUN_ID]] = (run_dir, max(newest, docker_time(service.attrs["UpdatedAt"])))
    removed = []
    for run_id, (run_dir, started_at) in sorted(runs.items()):
        if not run_is_live(run_dir, started_at, home, attach_seconds):
            removed += teardown_run(run_id, client)
            log.info("sweep: removed the services and network of interrupted run %s", run_id)
    return {"services": removed}


class SwarmBackend:
    """backend=swarm as a ``Backend`` (``hetflow.cluster.backends``)."""

    # A node is marked down after missing its heartbeats (5 s apart by default): seen here within 5 s.
    loss_report_seconds = 15.0

    def plan(self, spec: RunSpec, run_id: str) -> ClusterLayout:
        return plan(spec, run_id)

    def preflight(self, spec: RunSpec, run_id: str) -> list[str]:
        return preflight(spec, run_id)

    def replicas(self, spec: RunSpec, layout: ClusterLayout, run_dir: Path):
        return SwarmReplicas(layout, spec, run_dir)

    def teardown(self, spec: RunSpec, run_id: str, grace: float | None = None) -> list[str]:
        return teardown_run(run_id)

    def sweep(self, home: Path, grace: float | None = None) -> dict[str, list[str]]:
        return sweep_services(home, ATTACH_TIMEOUT_SECONDS if grace is None else grace)


BACKEND = SwarmBackend()

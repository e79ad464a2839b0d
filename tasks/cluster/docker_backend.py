"""Docker backend: one container per replica, on a network of the run's own.

Each replica is a container of the replica image running the same entry point as a local replica
(``python -m tasks.replica --run-dir DIR``) with the same TF_CONFIG; its peers are addressed by
container name (Docker's embedded DNS resolves names on a user-defined network). The network is
``internal``: TensorFlow's gRPC servers listen on every interface, and an internal network with no
published ports keeps them unreachable from outside the run. Every container and the network carry
the run's labels, so teardown finds them by run id whatever started them.

The configs are built by pure functions (``network_config``, ``container_config``) and passed to
the Docker SDK as they are; ``DockerCluster`` only starts, watches and stops.

HETFLOW_HOME is bind-mounted at the same path, so the supervisor and the Docker engine must share
a filesystem (the engine runs on the Airflow worker's host, or the compose stack's volume).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from pathlib import Path

import docker  # the Docker SDK (its docker.errors comes with it)

from tasks.cluster.containers import (
    STOP_GRACE_SECONDS,
    ReplicaState,
    pump_lines,
    replica_environment,
    replica_gpus,
    supervise,
)
from tasks.cluster.layout import ClusterLayout, Replica, plan_named_cluster, run_slug
from tasks.paths import hetflow_home
from tasks.spec import RunSpec

log = logging.getLogger("hetflow.cluster")

LABEL_RUN = "hetflow.run"  # the run's slug: what teardown filters on
LABEL_RUN_ID = "hetflow.run-id"  # the Airflow run id as it is
LABEL_ROLE = "hetflow.role"
LABEL_INDEX = "hetflow.index"


def network_name(run_id: str) -> str:
    return f"hetflow-{run_slug(run_id)}"


def container_name(run_id: str, replica_name: str) -> str:
    return f"hetflow-{run_slug(run_id)}-{replica_name}"


def plan(spec: RunSpec, run_id: str) -> ClusterLayout:
    return plan_named_cluster(spec, run_id, lambda name: container_name(run_id, name))


def run_labels(run_id: str) -> dict[str, str]:
    return {LABEL_RUN: run_slug(run_id), LABEL_RUN_ID: run_id}


def network_config(run_id: str) -> dict:
    """Keyword arguments of ``client.networks.create``."""
    return {"name": network_name(run_id), "driver": "bridge", "internal": True, "labels": run_labels(run_id)}


def container_config(
    layout: ClusterLayout, replica: Replica, spec: RunSpec, home: Path, run_dir: Path, user: str, launched_at: float
) -> dict:
    """Keyword arguments of ``client.containers.run`` for one replica.

    :param home: HETFLOW_HOME, bind-mounted at the same path.
    :param run_dir: the run directory (under ``home``).
    :param user: ``uid:gid`` the replica runs as: the supervisor's own, so that what the replica
        writes into the bind mount belongs to the user who reads it next.
    :param launched_at: when the supervisor launched the run (for time to first step).
    """
    config = {
        "image": spec.image,
        "command": ["--run-dir", str(run_dir)],
        "name": replica.host,
        "hostname": replica.host,
        "user": user,
        # The supervisor's uid has no home directory in the image; libraries that cache under
        # $HOME (matplotlib, TFDS) need a writable one.
        "environment": {**replica_environment(layout, replica, home, launched_at), "HOME": "/tmp"},
        "labels": {**run_labels(layout.run_id), LABEL_ROLE: replica.role, LABEL_INDEX: str(replica.index)},
        "network": network_name(layout.run_id),
        "volumes": {str(home): {"bind": str(home), "mode": "rw"}},
        "restart_policy": (
            {"Name": "on-failure", "MaximumRetryCount": spec.backoff_limit}
            if spec.restart_policy == "on_failure"
            else {"Name": "no"}
        ),
        "detach": True,
    }
    if spec.replica_cpus:
        config["nano_cpus"] = round(spec.replica_cpus * 1e9)
    if spec.replica_memory_mb:
        config["mem_limit"] = f"{spec.replica_memory_mb}m"
    gpus = replica_gpus(spec, replica)
    if gpus:
        config["device_requests"] = [{"Driver": "", "Count": gpus, "Capabilities": [["gpu"]]}]
    return config


def replica_state(attrs: dict) -> ReplicaState:
    """A container's state, from its ``docker inspect`` attributes."""
    state = attrs["State"]
    finished = state["Status"] in ("exited", "dead")
    return ReplicaState(exit_code=state["ExitCode"] if finished else None, restarts=attrs.get("RestartCount", 0))


class DockerCluster:
    """Starts, watches and stops the containers of one run; the same interface as LocalCluster."""

    def __init__(self, layout: ClusterLayout, spec: RunSpec, run_dir: Path, logs_dir: Path, client=None):
        self.layout = layout
        self.spec = spec
        self.run_dir = run_dir
        self.logs_dir = logs_dir
        self.client = client or docker.from_env()
        self.containers: dict[str, object] = {}
        self._tails: dict[str, deque[str]] = {r.name: deque(maxlen=20) for r in layout.replicas}
        self._pumps: list[threading.Thread] = []

    def start(self) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.client.networks.create(**network_config(self.layout.run_id))
        user = f"{os.getuid()}:{os.getgid()}"
        launched_at = time.time()
        for replica in self.layout.replicas:
            config = container_config(self.layout, replica, self.spec, hetflow_home(), self.run_dir, user, launched_at)
            container = self.client.containers.run(**config)
            self.containers[replica.name] = container
            pump = threading.Thread(target=self._pump, args=(replica.name, container), daemon=True)
            pump.start()
            self._pumps.append(pump)
            log.info("started %s (container %s) at %s", replica.name, container.short_id, replica.address)

    def _pump(self, name: str, container) -> None:
        try:
            pump_lines(name, container.logs(stream=True, follow=True), self.logs_dir / f"{name}.log", self._tails[name])
        except docker.errors.NotFound:  # removed by a stop while streaming: its output is in the file
            pass

    def _poll(self) -> dict[str, ReplicaState]:
        states = {}
        for name, container in self.containers.items():
            container.reload()
            states[name] = replica_state(container.attrs)
        return states

    def _stop(self, names: tuple[str, ...]) -> None:
        for name in names:
            try:
                self.containers[name].stop(timeout=STOP_GRACE_SECONDS)
            except docker.errors.NotFound:
                pass

    def wait(self, timeout: float) -> dict[str, int]:
        """Block until every training replica has exited 0 (then stop the servers); raise
        ReplicaFailed on a failed replica or a timeout, as the local backend does."""
        try:
            return supervise(self.layout, self.spec, self._poll, self._stop, self._tails, timeout)
        finally:
            for pump in self._pumps:
                pump.join(timeout=5)

    def stop(self) -> None:
        teardown_run(self.layout.run_id, self.client)


def teardown_run(run_id: str, client=None) -> list[str]:
    """Stop and remove every container of the run and its network, found by label. Returns the
    names of the containers removed."""
    client = client or docker.from_env()
    selector = {"label": f"{LABEL_RUN}={run_slug(run_id)}"}
    removed = []
    for container in client.containers.list(all=True, filters=selector):
        if container.status in ("running", "restarting", "paused"):
            container.stop(timeout=STOP_GRACE_SECONDS)
        container.remove(force=True)
        removed.append(container.name)
    for network in client.networks.list(filters=selector):
        network.remove()
    return removed

"""The Docker engine that backend=docker and backend=swarm drive: its client, made in one place, and
what their replicas share as the supervisor's ``Replicas``: a restart replaces what exited under
the same name, and the run's lease is held while they are supervised."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from pathlib import Path

import docker  # the Docker SDK (its docker.errors comes with it)

from hetflow.cluster.containers import container_user, prepare_run_dir
from hetflow.cluster.layout import ClusterLayout, Replica
from hetflow.cluster.lease import take_lease
from hetflow.paths import RunPaths, hetflow_home
from hetflow.spec import RunSpec


def engine_client() -> docker.DockerClient:
    """The engine the environment names (DOCKER_HOST, else the local socket), as the docker CLI finds it."""
    return docker.from_env()


class EngineReplicas(ABC):
    """One run's containers (docker) or services (swarm) for the supervisor. A subclass says how one
    replica's object is configured (``configure``), removed by name and created (``create``)."""

    restarts_in_place = False

    def __init__(self, layout: ClusterLayout, spec: RunSpec, run_dir: Path, client=None):
        self.layout = layout
        self.spec = spec
        self.run_dir = run_dir
        self.logs_dir = RunPaths(run_dir).logs
        self.client = client or engine_client()

    @abstractmethod
    def configure(self, replica: Replica, home: Path, user: str, launched_at: float) -> dict: ...

    @abstractmethod
    def remove_named(self, name: str) -> None: ...

    @abstractmethod
    def create(self, replica: Replica, config: dict) -> None: ...

    def start(self, replicas) -> None:
        prepare_run_dir(RunPaths(self.run_dir))
        launched_at = time.time()
        user = container_user(self.run_dir)
        for replica in replicas:
            config = self.configure(replica, hetflow_home(), user, launched_at)
            try:  # a restart: what exited gives way to a new one of the same name
                self.remove_named(config["name"])
            except docker.errors.NotFound:
                pass
            self.create(replica, config)

    def attach(self) -> None:
        """Hold the run's lease and beat its heartbeat: the replicas end themselves once it stops
        (``hetflow.cluster.lease``), and `hetflow sweep` leaves a supervised run alone."""
        self._lease = take_lease(self.run_dir, heartbeat=True)

    def detach(self) -> None:
        self._lease.close()

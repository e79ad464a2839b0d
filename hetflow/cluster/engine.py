"""The Docker engine that backend=docker and backend=swarm drive: its client, made in one place; the
names and labels by which a run's containers, services and networks are found; the digest that ties
the replica image to this checkout; and what their replicas share as the supervisor's ``Replicas``:
a restart replaces what exited under the same name, and the run's lease is held while they are
supervised."""

from __future__ import annotations

import hashlib
import time
from abc import abstractmethod
from pathlib import Path

import docker  # the Docker SDK (its docker.errors comes with it)

from hetflow.cluster.backends.base import Replicas
from hetflow.cluster.containers import container_user, prepare_run_dir
from hetflow.cluster.layout import ClusterLayout, Replica, run_slug
from hetflow.cluster.lease import take_lease
from hetflow.paths import REPO_ROOT, RunPaths, hetflow_home
from hetflow.spec import RunSpec

LABEL_RUN = "hetflow.run"  # the run's slug: what teardown filters on
LABEL_RUN_ID = "hetflow.run-id"  # the Airflow run id as it is
LABEL_RUN_DIR = "hetflow.run-dir"  # where its supervisor's lease is: how `hetflow sweep` tells a live run
LABEL_ROLE = "hetflow.role"
LABEL_INDEX = "hetflow.index"
# On the replica image: a digest of the code and pins it was built from (``source_digest``).
LABEL_SOURCE = "hetflow.source-digest"


def network_name(run_id: str) -> str:
    return f"hetflow-{run_slug(run_id)}"


def container_name(run_id: str, replica_name: str) -> str:
    return f"hetflow-{run_slug(run_id)}-{replica_name}"


def run_labels(run_id: str, run_dir: Path) -> dict[str, str]:
    return {LABEL_RUN: run_slug(run_id), LABEL_RUN_ID: run_id, LABEL_RUN_DIR: str(run_dir)}


def run_filter(run_id: str) -> dict:
    return {"label": f"{LABEL_RUN}={run_slug(run_id)}"}


def source_digest(root: Path = REPO_ROOT) -> str:
    """SHA-256 of what the replica image is built from: ``hetflow/`` (names and bytes) and the pins.
    ``make image`` labels the image with it; preflight compares, so an image built from other code
    than this checkout's is refused rather than run."""
    digest = hashlib.sha256()
    sources = sorted(p for p in (root / "hetflow").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in [*sources, root / "requirements.lock", root / "docker" / "replica-requirements.txt"]:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def engine_client() -> docker.DockerClient:
    """The engine the environment names (DOCKER_HOST, else the local socket), as the docker CLI finds it."""
    return docker.from_env()


class EngineReplicas(Replicas):
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

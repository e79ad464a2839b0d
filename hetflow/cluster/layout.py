"""The cluster layout: which replica has which role and address, and each replica's TF_CONFIG.

Backend-neutral: the local backend fills addresses with 127.0.0.1 and free ports
(``plan_cluster``); the container backends give every replica its own network name and the same
port (``plan_named_cluster``). Roles and TF_CONFIG are the same either way. Nothing here starts a
process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from dataclasses import asdict, dataclass
from typing import Callable

from hetflow.spec import RunSpec


@dataclass(frozen=True)
class Replica:
    role: str  # "chief", "worker" or "ps", as TF_CONFIG names them
    index: int
    address: str  # host:port of the replica's gRPC server
    # A server replica (ps, and workers under parameter_server) serves until it is stopped; a
    # training replica exits when training ends.
    serves_until_stopped: bool = False

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]


@dataclass(frozen=True)
class ClusterLayout:
    run_id: str
    replicas: tuple[Replica, ...]

    def cluster_spec(self) -> dict[str, list[str]]:
        spec: dict[str, list[str]] = {}
        for replica in self.replicas:
            spec.setdefault(replica.role, []).append(replica.address)
        return spec

    def tf_config(self, replica: Replica) -> str:
        return json.dumps({"cluster": self.cluster_spec(), "task": {"type": replica.role, "index": replica.index}})

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "replicas": [asdict(r) for r in self.replicas]}

    @classmethod
    def from_dict(cls, data: dict) -> "ClusterLayout":
        return cls(data["run_id"], tuple(Replica(**r) for r in data["replicas"]))


def free_local_port() -> int:
    """A port free on 127.0.0.1 right now (the OS picks it; a replica binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def replica_roles(spec: RunSpec) -> list[tuple[str, int, bool]]:
    """(role, index, serves_until_stopped) for the spec's strategy.

    Sync strategies run only workers, worker 0 being the chief (TensorFlow's convention when the
    cluster has no ``chief`` role); one replica even for one device, so the Airflow task only
    supervises. ``parameter_server`` runs a coordinating chief, workers and ps; ``model_parallel``
    across workers a chief driving workers that each hold a layer group.
    """
    if spec.cluster.chief_coordinates:
        return (
            [("chief", 0, False)]
            + [("worker", i, True) for i in range(spec.cluster.worker.replicas)]
            + [("ps", i, True) for i in range(spec.cluster.ps.replicas)]
        )
    return [("worker", i, False) for i in range(spec.cluster.worker.replicas)]


def plan_cluster(
    spec: RunSpec, run_id: str, host: str = "127.0.0.1", pick_port: Callable[[], int] = free_local_port
) -> ClusterLayout:
    roles = replica_roles(spec)
    ports: list[int] = []
    while len(ports) < len(roles):  # the OS may hand out a just-released port twice
        port = pick_port()
        if port not in ports:
            ports.append(port)
    return ClusterLayout(
        run_id,
        tuple(Replica(role, index, f"{host}:{port}", serves) for (role, index, serves), port in zip(roles, ports)),
    )


# TensorFlow's customary gRPC port. Every container has a network namespace of its own, so every
# replica can listen on the same one.
SERVICE_PORT = 2222


def run_slug(run_id: str) -> str:
    """The run id as a DNS-label fragment (lowercase letters, digits, '-'; at most 30 characters).

    Container, pod and service names and label values allow no ':' or '+' (Airflow run ids have
    both) and at most 63 characters; the hash of the full id keeps two runs whose ids differ only
    in cut or replaced characters apart."""
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    readable = re.sub(r"[^a-z0-9]+", "-", run_id.lower())[:21].strip("-")
    return f"{readable}-{digest}" if readable else digest


def plan_named_cluster(
    spec: RunSpec, run_id: str, host_of: Callable[[str], str], port: int = SERVICE_PORT
) -> ClusterLayout:
    """The layout for the container backends: the same replicas as ``plan_cluster``, each
    addressed by ``host_of(replica name)`` (a container or pod DNS name) and ``port``."""
    return ClusterLayout(
        run_id,
        tuple(
            Replica(role, index, f"{host_of(f'{role}-{index}')}:{port}", serves)
            for role, index, serves in replica_roles(spec)
        ),
    )


def core_assignment(layout: ClusterLayout) -> dict[str, int]:
    """One core per replica, round robin; workers first, as they do the compute, then ps, then
    the chief (which under parameter_server only coordinates)."""
    cores = sorted(os.sched_getaffinity(0))
    order = {"worker": 0, "ps": 1, "chief": 2}
    replicas = sorted(layout.replicas, key=lambda r: (order[r.role], r.index))
    return {replica.name: cores[i % len(cores)] for i, replica in enumerate(replicas)}

"""The one backend interface: a ``Backend`` per place replicas run, and the ``Replicas`` of one run
that it hands the supervisor.

A run's life on any backend, in order:

1. ``plan``: every replica's role, index and address (``ClusterLayout``); nothing starts.
2. ``preflight``: what would stop the replicas from starting (no image, no node, no namespace), one
   line each, checked before any process or container exists.
3. ``replicas(...).provision()``: the run's network and every replica started; the supervisor then
   ``attach``es, ``poll``s their states, reads their ``lines``, ``stop``s and ``start``s them again
   as the run policy says, and ``detach``es. What to restart and when a run has failed is decided by
   the one supervisor (``hetflow.cluster.supervisor``), never by a backend.
4. ``teardown``: everything of the run ended, found by its run id, whatever happened before.
5. ``sweep``: what interrupted runs left and no supervisor holds, removed.

Each backend lives in a room of its own (``hetflow.cluster.backends.<name>``) and declares there what
it supports; ``backend_for`` below is the one factory.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from hetflow.cluster.backends import NAMES
from hetflow.cluster.layout import ClusterLayout, Replica

if TYPE_CHECKING:
    from hetflow.spec import RunSpec


@dataclass(frozen=True)
class ReplicaState:
    exit_code: int | None = None  # None while it runs; negative: killed by that signal
    # Restarts the engine made by itself (the kubelet restarts a failed container in its pod).
    restarts: int = 0
    # Why it cannot start at all (an image that cannot be pulled): waiting would only time out.
    stuck: str | None = None
    # What the engine knows of how it ended beyond its exit code (its machine went down).
    note: str | None = None


class Replicas(ABC):
    """What a backend does for the supervisor. Where it can see its replicas' CPU and memory, it
    also offers ``usage_sampler()`` (``hetflow.cluster.usage``), for the live MLflow run."""

    # True where the engine restarts a failed replica in place (Kubernetes pods' restartPolicy):
    # the supervisor then counts its restarts instead of making them.
    restarts_in_place: bool
    layout: ClusterLayout

    @abstractmethod
    def provision(self) -> None:
        """Create what the run needs (its network, ...) and start every replica of the layout."""

    @abstractmethod
    def attach(self) -> None:
        """Become the replicas' supervisor (local replicas live only while one is attached)."""

    @abstractmethod
    def detach(self) -> None:
        """Stop being their supervisor."""

    @abstractmethod
    def start(self, replicas: Sequence[Replica]) -> None:
        """Start these replicas (again, after a restart)."""

    @abstractmethod
    def poll(self) -> dict[str, ReplicaState]:
        """Every replica's state, by name."""

    @abstractmethod
    def stop(self, names: Sequence[str]) -> None:
        """Stop these replicas, all at once, within the grace period."""

    @abstractmethod
    def lines(self, name: str, since: float) -> Iterator[str]:
        """The replica's output from ``since`` (epoch seconds) until it ends, line by line; the
        backend also keeps it in ``logs/<name>.log``."""


class Backend(ABC):
    """What every backend does, for one run at a time (the run named by ``run_id``)."""

    # Seconds the engine may take to report a replica lost with its machine (the supervisor waits
    # that long before blaming a peer that merely exited with an error); 0 where loss is seen at once.
    loss_report_seconds: float = 0.0

    @abstractmethod
    def plan(self, spec: RunSpec, run_id: str) -> ClusterLayout:
        """Every replica's role, index and address (nothing starts)."""

    @abstractmethod
    def preflight(self, spec: RunSpec, run_id: str) -> list[str]:
        """What would stop the run's replicas from starting, one line each."""

    # What ``replicas`` makes, from the layout, the spec and the run directory.
    replicas_type: type[Replicas]

    def replicas(self, spec: RunSpec, layout: ClusterLayout, run_dir: Path) -> Replicas:
        """The run's replicas for the supervisor."""
        return self.replicas_type(layout, spec, run_dir)

    @abstractmethod
    def teardown(self, spec: RunSpec | None, run_id: str, grace: float | None = None) -> list:
        """End everything of the run, found by its run id; the names of what was ended.

        :param grace: the most seconds a replica may take to end once told to (default: the backend's):
            local processes and Kubernetes pods get SIGTERM, then SIGKILL after it; docker's containers
            are killed at once, within any grace. Swarm's tasks are the exception: the engine gives
            them their service's stop grace period, fixed when the service was made
            (``containers.STOP_GRACE_SECONDS``)."""

    def sweep(self, home: Path, attach_seconds: float | None = None) -> dict[str, list[str]]:
        """Remove what interrupted runs of ``home`` left and no supervisor holds, by kind; nothing where
        a run leaves nothing once its supervisor is gone (local).

        :param attach_seconds: what started less than this many seconds ago may belong to a run being
            provisioned and is left alone (None: the attach timeout)."""
        return {}


def backend_for(spec: RunSpec | None) -> Backend:
    """The run's backend. Without a spec (validation failed) only local processes can exist."""
    return _backend_named(spec.cluster.backend if spec is not None else "local")


def _backend_named(name: str) -> Backend:
    # Imported only when chosen: the Docker SDK and the Kubernetes client cost time at import.
    return importlib.import_module(f"hetflow.cluster.backends.{name}.backend").BACKEND


def sweep(home: Path, attach_seconds: float | None = None) -> dict[str, list]:
    """``hetflow sweep``, and every teardown after its own run's: what interrupted runs of ``home`` left
    on every backend that can leave something — containers and networks (docker), services and overlay
    networks (swarm), the pods, services, NetworkPolicies and ConfigMaps of Kubernetes runs where a
    client configuration is found — of runs no supervisor holds (a local run leaves nothing).

    :param attach_seconds: containers, services and Kubernetes runs younger than this are left alone
        (default: the backends' attach timeout)."""
    removed: dict[str, list] = {}
    for name in NAMES:
        for kind, names in _backend_named(name).sweep(home, attach_seconds).items():
            removed[kind] = removed.get(kind, []) + names
    return removed

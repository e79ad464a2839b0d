"""The backends a run's replicas run on, one room each: ``local`` (processes on this machine),
``docker`` (containers), ``swarm`` (services across a swarm's nodes), ``kubernetes`` (pods).

Every backend implements the one interface in ``hetflow.cluster.backends.base`` (``Backend`` and the
``Replicas`` it hands the supervisor), in ``<name>/backend.py`` as ``BACKEND``; ``base.backend_for``
is the one factory. What a backend does with the spec's settings it declares in its room's
``__init__`` (``SUPPORTS``), which imports nothing of hetflow's but ``Supports``: the spec asks it
(``supports``), so checking a spec loads neither the Docker SDK nor the Kubernetes client.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

NAMES = ("local", "docker", "swarm", "kubernetes")


@dataclass(frozen=True)
class Supports:
    """What one backend does with the settings that not every backend can honour. A room declares
    only where it differs from these defaults: what a container engine on one machine does."""

    # replica_cpus, request_gpus: a container's, service's or pod's limits
    limits_cpus_and_gpus: bool = True
    # the run policy's restart_policy values it carries out
    restart_policies: tuple[str, ...] = ("never", "on_failure", "exit_code")
    # worker_devices node: a worker on the machine it names
    places_on_named_nodes: bool = False
    # encrypt_network=false: a network across machines left unencrypted
    network_encryption_optional: bool = False
    # why pin_cores (each replica on a core of its own) is refused; empty: it pins
    pin_cores_refused: str = ""
    # worker_devices slowdown: a slower machine simulated
    slows_workers: bool = True
    # data_dir and dataset=folder:PATH: folders of this machine reach the replicas
    mounts_host_folders: bool = True


def supports(name: str) -> Supports:
    """What backend ``name`` declares it supports."""
    return importlib.import_module(f"hetflow.cluster.backends.{name}").SUPPORTS


def backends_that(does) -> list[str]:
    """The backends for which ``does(their Supports)`` is true, in NAMES' order."""
    return [name for name in NAMES if does(supports(name))]

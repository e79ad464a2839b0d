"""Swarm backend: one Docker Swarm service (one task) per replica, spread over the swarm's nodes.

hetflow talks to a manager's engine (``DOCKER_HOST``). Every replica's service runs the replica
image's entry point with the same TF_CONFIG as on every backend; peers are addressed by service
name, which the swarm's DNS resolves to the service's task wherever it runs and after it is placed
again (``endpoint_mode=dnsrr``: virtual IPs need IPVS, which not every node has). The services sit on
an attachable, internal overlay network of the run's own (``network_config``): no route out and no
published port, encrypted between nodes unless ``encrypt_network=false`` (preflight refuses encryption
where a node's kernel says it has no IPsec ESP). The node a task runs on can still connect to the
task's port (measured on Docker 20.10 nodes): a node's other users are not kept out as the docker
backend keeps the host's out.

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
import time
from pathlib import Path

import docker

from hetflow.cluster.backends.base import Backend
from hetflow.cluster.backends.swarm.preflight import preflight
from hetflow.cluster.backends.swarm.replicas import SwarmReplicas, plan
from hetflow.cluster.engine import LABEL_RUN, LABEL_RUN_DIR, LABEL_RUN_ID, engine_client, run_filter
from hetflow.spec import RunSpec

log = logging.getLogger("hetflow.cluster")


def teardown_run(run_id: str, client=None) -> list[str]:
    """Remove every service of the run (their tasks stop), then its network, found by label.
    Returns the names of the services removed."""
    client = client or engine_client()
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


def sweep_services(home: Path, attach_seconds: float | None = None) -> dict[str, list[str]]:
    """Remove the services and overlay networks of this home's runs that no supervisor holds.
    Nothing to do where the engine is not a swarm manager."""
    from hetflow.cluster.sweep import docker_time, interrupted_runs

    try:
        client = engine_client()
        services = client.services.list(filters={"label": LABEL_RUN})
    except docker.errors.DockerException:  # no engine, or not a swarm manager
        return {"services": []}
    parts = []
    for service in services:
        labels = service.attrs["Spec"].get("Labels") or {}
        parts.append((labels[LABEL_RUN_ID], labels[LABEL_RUN_DIR], docker_time(service.attrs["UpdatedAt"])))
    removed = []
    for run_id in interrupted_runs(parts, home, attach_seconds):
        removed += teardown_run(run_id, client)
        log.info("sweep: removed the services and network of interrupted run %s", run_id)
    return {"services": removed}


class SwarmBackend(Backend):
    """backend=swarm as a ``Backend`` (``hetflow.cluster.backends.base``)."""

    # SwarmKit marks a node down after three missed heartbeats (5 s apart by default, plus up to
    # 0.5 s of jitter): up to about 17 s after it died, while a peer exits on the broken connection
    # within a second or two. Twice that leaves room for a busy manager.
    loss_report_seconds = 35.0
    replicas_type = SwarmReplicas
    plan = staticmethod(plan)
    preflight = staticmethod(preflight)
    sweep = staticmethod(sweep_services)

    def teardown(self, spec: RunSpec, run_id: str, grace: float | None = None) -> list[str]:
        return teardown_run(run_id)  # the services' stop grace period was fixed when they were made


BACKEND = SwarmBackend()

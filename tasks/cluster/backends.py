"""The backend a run uses, chosen by ``spec.backend``: how its layout is planned, what starts its
replicas, what the supervisor asks about them, and how teardown finds what is left of it."""

from __future__ import annotations

from pathlib import Path

from tasks.cluster.layout import ClusterLayout, plan_cluster
from tasks.cluster.supervisor import Supervisor
from tasks.spec import RunSpec


def plan(spec: RunSpec, run_id: str) -> ClusterLayout:
    if spec.backend == "docker":
        from tasks.cluster import docker_backend

        return docker_backend.plan(spec, run_id)
    if spec.backend == "kubernetes":
        from tasks.cluster import kubernetes_backend

        return kubernetes_backend.plan(spec, run_id)
    return plan_cluster(spec, run_id)


def preflight(spec: RunSpec, run_id: str) -> list[str]:
    """What would stop the run's replicas from starting on its backend, one line each (checked
    before anything starts; the local backend needs nothing beyond the spec)."""
    if spec.backend == "docker":
        from tasks.cluster import docker_backend

        return docker_backend.preflight(spec, run_id)
    return []


def replicas(spec: RunSpec, layout: ClusterLayout, run_dir: Path, probe: bool = False):
    """The run's LocalReplicas, DockerReplicas or KubernetesReplicas (``supervisor.Replicas``)."""
    if spec.backend == "docker":
        from tasks.cluster.docker_backend import DockerReplicas

        return DockerReplicas(layout, spec, run_dir, probe=probe)
    if spec.backend == "kubernetes":
        from tasks.cluster.kubernetes_backend import KubernetesReplicas

        return KubernetesReplicas(layout, spec, run_dir)
    from tasks.cluster.local import LocalReplicas

    return LocalReplicas(layout, spec, run_dir, probe=probe)


def supervise(spec: RunSpec, cluster, run_dir: Path, timeout: float) -> dict[str, int]:
    """Watch ``cluster`` (provisioned replicas) until training ends: the training replicas' exit
    codes, or ReplicaFailed. Local replicas live only while a supervisor holds their lease."""
    supervisor = Supervisor(cluster.layout, spec.restart_policy, spec.backoff_limit, cluster, run_dir)
    cluster.attach()
    try:
        supervisor.follow(r.name for r in cluster.layout.replicas)
        return supervisor.wait(timeout)
    finally:
        cluster.detach()


def teardown(spec: RunSpec | None, run_id: str, grace: float | None = None) -> list:
    """End everything of the run: pids (local), container names (docker), object names
    (kubernetes). Without a spec (validation failed), only local processes can exist.

    :param grace: seconds local replicas get between SIGTERM and SIGKILL (default: the backend's);
        containers are killed at once, pods get Kubernetes' own grace."""
    if spec is not None and spec.backend == "docker":
        from tasks.cluster import docker_backend

        return docker_backend.teardown_run(run_id)
    if spec is not None and spec.backend == "kubernetes":
        from tasks.cluster import kubernetes_backend

        return kubernetes_backend.teardown_run(run_id, spec.kubernetes_namespace)
    from tasks.cluster.processes import TERM_GRACE_SECONDS, teardown_run

    return teardown_run(run_id, TERM_GRACE_SECONDS if grace is None else grace)

"""The backend a run uses, chosen by ``spec.backend``: how its layout is planned, what starts its
replicas, and how teardown finds what is left of it."""

from __future__ import annotations

from pathlib import Path

from tasks.cluster.layout import ClusterLayout, plan_cluster
from tasks.spec import RunSpec


def plan(spec: RunSpec, run_id: str) -> ClusterLayout:
    if spec.backend == "docker":
        from tasks.cluster import docker_backend

        return docker_backend.plan(spec, run_id)
    if spec.backend == "kubernetes":
        from tasks.cluster import kubernetes_backend

        return kubernetes_backend.plan(spec, run_id)
    return plan_cluster(spec, run_id)


def make_cluster(spec: RunSpec, layout: ClusterLayout, run_dir: Path, logs_dir: Path):
    """A LocalCluster, DockerCluster or KubernetesCluster: start(), wait(timeout), stop()."""
    if spec.backend == "docker":
        from tasks.cluster.docker_backend import DockerCluster

        return DockerCluster(layout, spec, run_dir, logs_dir)
    if spec.backend == "kubernetes":
        from tasks.cluster.kubernetes_backend import KubernetesCluster

        return KubernetesCluster(layout, spec, run_dir, logs_dir)
    from tasks.cluster.local import LocalCluster

    return LocalCluster(layout, spec, run_dir, logs_dir)


def teardown(spec: RunSpec | None, run_id: str) -> list:
    """End everything of the run: pids (local), container names (docker), object names
    (kubernetes). Without a spec (validation failed), only local processes can exist."""
    if spec is not None and spec.backend == "docker":
        from tasks.cluster import docker_backend

        return docker_backend.teardown_run(run_id)
    if spec is not None and spec.backend == "kubernetes":
        from tasks.cluster import kubernetes_backend

        return kubernetes_backend.teardown_run(run_id, spec.kubernetes_namespace)
    from tasks.cluster.local import teardown_run

    return teardown_run(run_id)

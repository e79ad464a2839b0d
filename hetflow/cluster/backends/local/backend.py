"""backend=local as a ``Backend`` (``hetflow.cluster.backends.base``): replicas are processes on this
machine (``hetflow.cluster.backends.local.replicas``), found by run id (``hetflow.cluster.processes``)."""

from __future__ import annotations

from pathlib import Path

from hetflow.cluster.backends.base import Backend
from hetflow.cluster.layout import ClusterLayout, plan_cluster
from hetflow.spec import RunSpec


class LocalBackend(Backend):
    """backend=local as a ``Backend``. Its sweep removes nothing: a run's replicas and the holder of its
    network namespace die with their keepers' supervisor lease (``keeper``), and the kernel frees the
    namespace with them."""

    def plan(self, spec: RunSpec, run_id: str) -> ClusterLayout:
        return plan_cluster(spec, run_id)

    def preflight(self, spec: RunSpec, run_id: str) -> list[str]:
        return []  # nothing beyond the spec, which is already checked

    def replicas(self, spec: RunSpec, layout: ClusterLayout, run_dir: Path):
        from hetflow.cluster.backends.local.replicas import LocalReplicas

        return LocalReplicas(layout, spec, run_dir)

    def teardown(self, spec: RunSpec | None, run_id: str, grace: float | None = None) -> list:
        from hetflow.cluster.processes import TERM_GRACE_SECONDS, teardown_run

        return teardown_run(run_id, TERM_GRACE_SECONDS if grace is None else grace)


BACKEND = LocalBackend()

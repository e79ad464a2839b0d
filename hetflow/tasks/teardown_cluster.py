"""teardown_cluster: the run's replicas ended whatever happened (Airflow's teardown of
``provision_cluster``), and what interrupted runs left swept."""

from __future__ import annotations

import logging

from hetflow.paths import hetflow_home, run_paths
from hetflow.pipeline.attempts import load_spec, reported

log = logging.getLogger("hetflow.stages")


@reported
def teardown_cluster(run_id: str) -> list:
    """End what is left of the run's replicas: pids (local), containers (docker), pods (kubernetes)."""
    from hetflow.cluster.backends.base import backend_for, sweep

    paths = run_paths(run_id)
    spec = load_spec(paths) if paths.spec.exists() else None
    ended = backend_for(spec).teardown(spec, run_id)
    log.info("teardown: %s", f"ended {ended}" if ended else "no replica was left running")
    try:  # what earlier runs left when they were killed before their own teardown
        swept = sweep(hetflow_home())
    except Exception:  # another run's leftovers must not fail this run's teardown
        log.exception("sweeping what interrupted runs left failed")
    else:
        if any(swept.values()):
            log.info("teardown also swept what interrupted runs left: %s", swept)
    return ended

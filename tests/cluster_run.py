"""The run the backend tests plan for, a parameter-server spec of it, a swarm sync spec over two named
nodes, and the ConfigMap that owns its Kubernetes objects."""

from __future__ import annotations

from pathlib import Path

from hetflow.cluster.backends.kubernetes import manifests as manifests
from hetflow.spec import parse_spec

RUN_ID = "manual__2026-11-22T00:12:03.120579+00:00"  # an Airflow run id: ':' and '+' included
HOME = Path("/srv/hetflow")
RUN_DIR = HOME / "runs" / "manual__2026-11-22T00_12_03.120579_00_00"
OWNER = manifests.owner_reference(manifests.run_name(RUN_ID), "0b8e4a3c-6f0e-4a8e-9c1b-2d3e4f5a6b7c")


def ps_spec(backend: str, **values):
    return parse_spec({"backend": backend, "strategy": "parameter_server", "workers": 2, "ps": 1, **values})


def swarm_sync_spec(**values):
    """Two multi_worker_mirrored workers on a swarm, one on each of node-1 and node-2."""
    return parse_spec(
        {
            "backend": "swarm",
            "strategy": "multi_worker_mirrored",
            "workers": 2,
            "worker_devices": [{"node": "node-1"}, {"node": "node-2"}],
            # This machine's kernel has no IPsec ESP (checked in the preflight test)
            "encrypt_network": False,
            **values,
        }
    )

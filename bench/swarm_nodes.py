"""A swarm of Docker-in-Docker nodes for a bench, brought up and torn down by the project's own
``docker/swarm.sh`` (what ``make swarm`` / ``make swarm-down`` and the swarm tests use), with a
prefix of its own so that it never meets a user's or a test's swarm."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from throughput_cases import REPO_ROOT

PREFIX = "hetflow-swarm-bench"


def node_cpus(nodes: str) -> dict[str, float]:
    """``"node-1:1.0:cpu node-2:0.5:cpu"`` (swarm.sh's SWARM_NODES) as {node: CPUs}."""
    return {name: float(cpus) for name, cpus, _ in (node.split(":") for node in nodes.split())}


def _swarm_sh(action: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [str(REPO_ROOT / "docker/swarm.sh"), action], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"docker/swarm.sh {action} failed: {(done.stdout + done.stderr).strip()[-2000:]}")
    return done.stdout


def left_on_engine() -> list[str]:
    """What of the bench's swarm is still on this machine's engine: containers, volumes, network."""
    import docker

    client = docker.from_env()
    return (
        [c.name for c in client.containers.list(all=True, filters={"label": f"hetflow.swarm={PREFIX}"})]
        + [v.name for v in client.volumes.list(filters={"name": PREFIX})]
        + [n.name for n in client.networks.list(names=[PREFIX])]
    )


@contextmanager
def swarm(env: dict[str, str], nodes: str) -> Iterator[dict[str, str]]:
    """``env`` for hetflow to run on a swarm of ``nodes`` (SWARM_NODES) sharing ``env``'s
    HETFLOW_HOME: DOCKER_HOST is its manager. Down afterwards; raises if anything is left."""
    fixture_env = {**env, "SWARM_PREFIX": PREFIX, "SWARM_NODES": nodes, "SWARM_SHARED": env["HETFLOW_HOME"]}
    try:
        up = _swarm_sh("up", fixture_env)
        docker_host = up.strip().splitlines()[-1].split("=", 1)[1]  # its last line: export DOCKER_HOST=...
        yield {**env, "DOCKER_HOST": docker_host}
    finally:
        _swarm_sh("down", fixture_env)
        left = left_on_engine()
        if left:
            raise RuntimeError(f"docker/swarm.sh down left on the engine: {', '.join(left)}")

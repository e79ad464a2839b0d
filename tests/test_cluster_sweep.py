"""``hetflow sweep`` and every teardown remove what interrupted runs left, and nothing of a live run:
real containers and networks on the engine `make test` starts. A local run leaves nothing to sweep:
its replicas and the holder of its network namespace die with their supervisor (tests/test_cluster_local.py)."""

from __future__ import annotations

import uuid

import pytest
from conftest import hetflow

from hetflow.cluster.backends.base import sweep


def _run_container(client, run_id: str, run_dir, name: str):
    """A container and network labelled as hetflow's docker backend labels a run's."""
    from hetflow.cluster.backends.docker.backend import network_config
    from hetflow.cluster.engine import run_labels

    network = client.networks.create(**{**network_config(run_id, run_dir), "name": f"{name}-net"})
    container = client.containers.run(
        "hetflow-replica:0.1.0",
        entrypoint=["sleep", "300"],
        name=name,
        labels=run_labels(run_id, run_dir),
        network=network.name,
        detach=True,
    )
    return container, network


@pytest.mark.slow
def test_containers_of_runs_no_supervisor_holds_go_and_live_runs_stay(docker_client, tmp_path):
    import docker

    from hetflow.cluster.lease import take_lease

    home = tmp_path / "home"
    tag = uuid.uuid4().hex[:8]
    runs = {kind: home / "runs" / f"{kind}-{tag}" for kind in ("interrupted", "supervised")}
    for run_dir in runs.values():
        run_dir.mkdir(parents=True)
    elsewhere = tmp_path / "other-home" / "runs" / f"theirs-{tag}"
    made = {
        "interrupted": _run_container(docker_client, f"interrupted-{tag}", runs["interrupted"], f"sweep-a-{tag}"),
        "supervised": _run_container(docker_client, f"supervised-{tag}", runs["supervised"], f"sweep-b-{tag}"),
        "other home": _run_container(docker_client, f"theirs-{tag}", elsewhere, f"sweep-c-{tag}"),
    }
    lease = take_lease(runs["supervised"])
    try:
        assert sweep(home)["containers"] == []  # every container started within the attach window
        removed = sweep(home, attach_seconds=0)
        assert removed["containers"] == [f"sweep-a-{tag}"]
        assert {c.name for c in docker_client.containers.list(all=True, filters={"name": f"sweep-.-{tag}"})} == {
            f"sweep-b-{tag}",
            f"sweep-c-{tag}",
        }
        assert {n.name for n in docker_client.networks.list(names=[f"sweep-a-{tag}-net"])} == set()
    finally:
        lease.close()
        for container, network in made.values():
            for thing in (container, network):
                try:
                    thing.remove(**({"force": True} if thing is container else {}))
                except docker.errors.NotFound:
                    pass


def test_the_sweep_command_reports_what_it_removed(hetflow_env):
    done = hetflow(hetflow_env, "sweep")
    assert done.returncode == 0, done.stderr[-2000:]
    kinds = [line.split(":")[0] for line in done.stdout.strip().splitlines()]
    assert kinds == ["containers", "networks", "services"]


@pytest.mark.slow
def test_every_teardown_sweeps_what_earlier_runs_left(docker_client, hetflow_env, monkeypatch):
    import docker

    from hetflow.cluster import sweep as sweep_rules
    from hetflow.paths import run_paths
    from hetflow.tasks.teardown_cluster import teardown_cluster
    from hetflow.tasks.validate_spec import validate_spec

    monkeypatch.setattr(sweep_rules, "ATTACH_TIMEOUT_SECONDS", 0)  # what every sweep leaves alone by default
    tag = uuid.uuid4().hex[:8]
    interrupted = run_paths(f"sweep-interrupted-{tag}").root
    interrupted.mkdir(parents=True)  # a run whose supervisor was killed: no lease held
    container, network = _run_container(docker_client, f"sweep-interrupted-{tag}", interrupted, f"sweep-d-{tag}")
    try:
        run_id = f"sweeping_teardown_{tag}"
        validate_spec({}, run_id)
        teardown_cluster(run_id)
        assert docker_client.containers.list(all=True, filters={"name": f"sweep-d-{tag}"}) == []
        assert docker_client.networks.list(names=[f"sweep-d-{tag}-net"]) == []
    finally:
        for thing in (container, network):
            try:
                thing.remove(**({"force": True} if thing is container else {}))
            except docker.errors.NotFound:
                pass

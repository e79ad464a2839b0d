"""``hetflow sweep`` and every teardown remove what interrupted runs left, and nothing of a live run:
real network namespaces, real containers and networks on the engine `make test` starts."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest
from conftest import hetflow, wait_for

from tasks.cluster.backends import sweep
from tasks.cluster.netns import namespace_processes


def _netns_missing() -> str | None:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return "network namespaces need root and iproute2"
    return None


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


@pytest.mark.skipif(_netns_missing() is not None, reason=_netns_missing() or "")
def test_empty_namespaces_of_killed_runs_go_and_occupied_ones_stay(tmp_path):
    left, occupied = f"hetflow-{uuid.uuid4().hex[:12]}", f"hetflow-{uuid.uuid4().hex[:12]}"
    for name in (left, occupied):
        subprocess.run(["ip", "netns", "add", name], check=True)
    resident = subprocess.Popen(["ip", "netns", "exec", occupied, "sleep", "300"])
    try:
        assert wait_for(lambda: namespace_processes(occupied), timeout=10)
        assert sweep(tmp_path, namespace_grace=60)["namespaces"] == []  # both too young to judge
        removed = sweep(tmp_path, namespace_grace=0)["namespaces"]
        assert left in removed and occupied not in removed
        assert left not in _namespaces() and occupied in _namespaces()
    finally:
        resident.kill()
        resident.wait()
        subprocess.run(["ip", "netns", "delete", occupied])


def _run_container(client, run_id: str, run_dir, name: str):
    """A container and network labelled as hetflow's docker backend labels a run's."""
    from tasks.cluster.docker_backend import network_config, run_labels

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

    from tasks.cluster.keeper import take_lease

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
    assert kinds == ["namespaces", "containers", "networks", "services"]


@pytest.mark.skipif(_netns_missing() is not None, reason=_netns_missing() or "")
def test_every_teardown_sweeps_what_earlier_runs_left(hetflow_env, monkeypatch):
    from tasks.cluster import sweep as sweeping
    from tasks.teardown_cluster import teardown_cluster
    from tasks.validate_spec import validate_spec

    monkeypatch.setattr(sweeping, "NAMESPACE_GRACE_SECONDS", 0)
    left = f"hetflow-{uuid.uuid4().hex[:12]}"
    subprocess.run(["ip", "netns", "add", left], check=True)
    run_id = f"sweeping_teardown_{os.getpid()}"
    validate_spec({}, run_id)
    teardown_cluster(run_id)
    assert left not in _namespaces()

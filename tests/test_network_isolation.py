"""Local replicas in a network namespace of their run (#17): their gRPC servers, which listen on
every interface without authentication, are unreachable from this host's network and reachable
from inside the namespace; the namespace goes with the run. Real processes; the isolated cases
need root and iproute2 (they skip, saying why, without them)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from conftest import REPO, hetflow, listening, wait_for

from tasks.cluster.local import LocalReplicas
from tasks.cluster.processes import run_processes, run_replicas, teardown_runs_of_home
from tasks.paths import hetflow_home, run_paths


def _namespaces() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _netns_missing() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("ip") and shutil.which("nsenter")):
        return "no ip or nsenter command"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    return None


needs_netns = pytest.mark.skipif(_netns_missing() is not None, reason=_netns_missing() or "")


def _net_namespace(pid: int) -> tuple[int, int]:
    status = os.stat(f"/proc/{pid}/ns/net")
    return status.st_dev, status.st_ino


def _connects(host: str, port: int) -> bool:
    """Whether a TCP connection from this process's network namespace to host:port is accepted."""
    with socket.socket() as client:
        client.settimeout(2)
        client.bind((host, 0))
        if client.getsockname()[1] == port:  # would connect to itself (TCP simultaneous open)
            return _connects(host, port)
        try:
            client.connect((host, port))
        except OSError:
            return False
        return True


_CONNECT_FROM_INSIDE = textwrap.dedent(
    """
    import socket, sys, time
    deadline = time.monotonic() + 120
    for port in map(int, sys.argv[1:]):
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    sys.exit(f"nothing accepts on 127.0.0.1:{port}")
                time.sleep(0.2)
    print("connected")
    """
)


def _host_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback."""
    return [
        address.address
        for addresses in psutil.net_if_addrs().values()
        for address in addresses
        if address.family == socket.AF_INET and not address.address.startswith("127.")
    ]


@needs_netns
def test_replicas_are_reachable_only_inside_their_namespace_which_teardown_deletes(provisioned):
    from tasks.attempts import load_spec

    devices = [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1, "slowdown": 4}]
    run_id = provisioned(strategy="multi_worker_mirrored", workers=2, worker_devices=devices)
    record = json.loads(run_paths(run_id).cluster.read_text())
    name = record["network_isolation"]["namespace"]
    assert record["network_isolation"] == {"isolated": True, "namespace": name} and name in _namespaces()
    ports = [int(r["address"].rsplit(":", 1)[1]) for r in record["replicas"]]

    inside = subprocess.run(
        ["ip", "netns", "exec", name, sys.executable, "-c", _CONNECT_FROM_INSIDE, *map(str, ports)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert inside.stdout.strip() == "connected", inside.stderr
    assert len(_host_addresses()) >= 1
    for port in ports:
        assert not listening(f"127.0.0.1:{port}")  # the host's kernel knows of no listener
        for host in ["127.0.0.1", *_host_addresses()]:
            assert not _connects(host, port), f"{host}:{port} accepted a connection from outside the namespace"

    processes = run_processes(run_id)  # the keepers and their replicas, all inside
    namespace = os.stat(f"/run/netns/{name}")
    assert len(processes) == 4
    assert {_net_namespace(pid) for pid in processes} == {(namespace.st_dev, namespace.st_ino)}

    # Signals still reach them: the keeper throttles worker-1 (slowdown 4) with SIGSTOP/SIGCONT.
    slowed = run_replicas(run_id)["worker-1"]
    assert wait_for(lambda: psutil.Process(slowed).status() == psutil.STATUS_STOPPED, timeout=5, interval=0.001)

    # A restart comes from the supervising task, which did not provision: it reads the namespace
    # from cluster.json. (This worker-0 duplicates the running one; only where it starts matters.)
    from tasks.cluster.layout import ClusterLayout

    paths = run_paths(run_id)
    layout = ClusterLayout.from_dict(record)
    restarted = LocalReplicas(layout, load_spec(paths), paths.root)
    restarted.start(layout.replicas[:1])
    keeper = restarted._keeper("worker-0")  # nsenter, until it has entered the namespace and exec'd the keeper
    assert wait_for(lambda: _net_namespace(keeper) == (namespace.st_dev, namespace.st_ino), timeout=10)

    # What `make down` does (the DAG's teardown task and `hetflow train` call teardown_run).
    teardown_runs_of_home(hetflow_home())
    assert run_processes(run_id) == []
    assert name not in _namespaces()


@needs_netns
@pytest.mark.slow
def test_a_short_training_run_succeeds_inside_its_namespace(hetflow_env):
    args = ["strategy=multi_worker_mirrored", "workers=2", "epochs=2", "steps_per_epoch=4", "batch_size=32"]
    args += ["train_timeout_seconds=180"]  # workers that cannot reach each other hang until then
    done = hetflow(hetflow_env, "train", *[token for key in args for token in ("--set", key)])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    run_dir = Path(done.stdout.strip().splitlines()[-1]).parent
    record = json.loads((run_dir / "training.json").read_text())
    assert record["replicas_in_sync"] == 2 and sorted(record["per_worker"]) == ["worker-0", "worker-1"]
    isolation = json.loads((run_dir / "cluster.json").read_text())["network_isolation"]
    assert isolation["isolated"] is True
    for worker in ("worker-0", "worker-1"):
        started = (
            rf"started {worker} \(keeper pid \d+\) at 127\.0\.0\.1:\d+, in network namespace {isolation['namespace']}"
        )
        assert re.search(started, done.stderr), done.stderr[-4000:]
    assert isolation["namespace"] not in _namespaces()  # the CLI's teardown deleted it


_PROVISION = textwrap.dedent(
    """
    import sys
    from tasks.prepare_data import prepare_data
    from tasks.provision_cluster import provision_cluster
    from tasks.validate_spec import validate_spec
    validate_spec({"epochs": 1000, "strategy": "multi_worker_mirrored", "workers": 2}, sys.argv[1])
    prepare_data(sys.argv[1])
    provision_cluster(sys.argv[1])
    """
)


def test_without_iproute2_the_run_records_and_warns_that_it_is_not_isolated(hetflow_env):
    """The fallback (as without root): replicas on this host's ports, and the run says so."""
    from tasks.teardown_cluster import teardown_cluster

    run_id = f"netns_fallback_{os.getpid()}"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROVISION, run_id],
            cwd=REPO,
            env={**hetflow_env, "PATH": str(REPO / "nonexistent")},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        record = json.loads(run_paths(run_id).cluster.read_text())
        assert record["network_isolation"] == {
            "isolated": False,
            "reason": "no `ip` (iproute2) or `nsenter` (util-linux) command on PATH",
        }
        assert "listen on every interface of this host, without authentication" in done.stderr
        addresses = [replica["address"] for replica in record["replicas"]]
        assert wait_for(lambda: all(map(listening, addresses)), timeout=90), "the replicas never listened here"
    finally:
        teardown_cluster(run_id)
    assert run_processes(run_id) == []

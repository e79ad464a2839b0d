"""Local replicas in a network namespace of their run (``hetflow.cluster.backends.local.netns``): their gRPC servers,
which listen on every interface without authentication, are unreachable from this host's network
and reachable from inside the run's sandboxes; every replica of the run, restarted ones included,
shares the one namespace, which goes with the run. Real processes in real bubblewrap sandboxes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from conftest import REPO, hetflow, listening, wait_for

from hetflow.cluster.backends.local import netns
from hetflow.cluster.backends.local.replicas import LocalReplicas
from hetflow.cluster.processes import RUN_ID_ENV, environments_with, run_processes, teardown_runs_of_home
from hetflow.paths import RunPaths, hetflow_home, run_paths


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


def _replica_processes(run_id: str) -> list[int]:
    """Every live replica process of the run, inside its sandbox (two may share a name)."""
    found = []
    for pid in environments_with(f"{RUN_ID_ENV}={run_id}", anywhere=True):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"hetflow.replica"]:
                found.append(pid)
        except OSError:
            continue
    return found


@pytest.mark.replicas
def test_replicas_are_reachable_only_inside_their_namespace_which_all_of_them_share(provisioned):
    from hetflow.cluster.backends.local import keeper
    from hetflow.cluster.backends.local.replicas import file_view
    from hetflow.cluster.layout import ClusterLayout
    from hetflow.pipeline.attempts import load_spec

    devices = [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1, "slowdown": 4}]
    run_id = provisioned(strategy="multi_worker_mirrored", workers=2, worker_devices=devices)
    paths = run_paths(run_id)
    record = json.loads(paths.cluster.read_text())
    assert record["network_isolation"] == {"isolated": True, "sandbox": "bubblewrap"}
    ports = [int(r["address"].rsplit(":", 1)[1]) for r in record["replicas"]]

    view = file_view(load_spec(paths), paths.root)
    box = keeper.replica_sandbox(keeper.View(view["read_write"], view["read_only"], view["hidden"]), paths.root)
    try:
        inside = subprocess.run(
            box.command([sys.executable, "-c", _CONNECT_FROM_INSIDE, *map(str, ports)]),
            pass_fds=box.fds,
            capture_output=True,
            text=True,
            timeout=150,
        )
    finally:
        box.close()
    assert inside.stdout.strip() == "connected", inside.stderr
    assert len(_host_addresses()) >= 1
    for port in ports:
        assert not listening(f"127.0.0.1:{port}")  # the host's kernel knows of no listener
        for host in ["127.0.0.1", *_host_addresses()]:
            assert not _connects(host, port), f"{host}:{port} accepted a connection from outside the namespace"

    holder = json.loads(netns.record_path(paths.root).read_text())
    assert holder["net"] != netns.namespace_of(os.getpid())
    assert wait_for(lambda: len(_replica_processes(run_id)) == 2, timeout=60)
    assert {netns.namespace_of(pid) for pid in _replica_processes(run_id)} == {holder["net"]}

    # Signals still reach them: the keeper throttles worker-1 (slowdown 4) with SIGSTOP/SIGCONT.
    from hetflow.cluster.processes import run_replicas

    slowed = run_replicas(run_id)["worker-1"]
    assert wait_for(lambda: psutil.Process(slowed).status() == psutil.STATUS_STOPPED, timeout=5, interval=0.001)

    # A restart comes from the supervising task, which did not provision: it joins the same
    # namespace. (This worker-0 duplicates the running one; only where it starts matters.)
    layout = ClusterLayout.from_dict(record)
    restarted = LocalReplicas(layout, load_spec(paths), paths.root)
    restarted.start(layout.replicas[:1])
    assert wait_for(lambda: len(_replica_processes(run_id)) == 3, timeout=60)
    assert {netns.namespace_of(pid) for pid in _replica_processes(run_id)} == {holder["net"]}

    # What `make down` does (the DAG's teardown task and `hetflow train` call teardown_run).
    teardown_runs_of_home(hetflow_home())
    assert run_processes(run_id) == []
    assert wait_for(lambda: _replica_processes(run_id) == [], timeout=5)


@pytest.mark.slow
def test_a_short_training_run_succeeds_inside_its_namespace(hetflow_env):
    args = ["strategy=multi_worker_mirrored", "workers=2", "epochs=2", "steps_per_epoch=4", "batch_size=32"]
    args += ["train_timeout_seconds=180"]  # workers that cannot reach each other hang until then
    done = hetflow(hetflow_env, "train", *[token for key in args for token in ("--set", key)])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    run_dir = Path(done.stdout.strip().splitlines()[-1]).parents[1]  # training.json is in its output folder
    record = json.loads(RunPaths(run_dir).training.read_text())
    assert record["replicas_in_sync"] == 2 and sorted(record["per_worker"]) == ["worker-0", "worker-1"]
    isolation = json.loads((run_dir / "cluster.json").read_text())["network_isolation"]
    assert isolation == {"isolated": True, "sandbox": "bubblewrap"}
    for worker in ("worker-0", "worker-1"):
        started = rf"started {worker} \(keeper pid \d+\) at 127\.0\.0\.1:\d+, sandboxed in the run's network namespace"
        assert re.search(started, done.stderr), done.stderr[-4000:]


_PROVISION = textwrap.dedent(
    """
    import sys
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.provision_cluster import provision_cluster
    from hetflow.tasks.validate_spec import validate_spec
    validate_spec({"epochs": 1000, "strategy": "multi_worker_mirrored", "workers": 2}, sys.argv[1])
    prepare_data(sys.argv[1])
    provision_cluster(sys.argv[1])
    """
)


def test_without_bubblewrap_a_run_the_operator_accepted_unisolated_says_so(hetflow_env):
    """The fallback, only with HETFLOW_ALLOW_UNISOLATED=1: replicas on this host's ports, and the
    run records and warns that they are."""
    from hetflow.tasks.teardown_cluster import teardown_cluster

    run_id = f"unisolated_{os.getpid()}"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROVISION, run_id],
            cwd=REPO,
            env={**hetflow_env, "PATH": str(REPO / "nonexistent"), "HETFLOW_ALLOW_UNISOLATED": "1"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        record = json.loads(run_paths(run_id).cluster.read_text())
        reason = "no `bwrap` on PATH (Debian's bubblewrap package)"
        assert record["network_isolation"] == {"isolated": False, "reason": reason}
        assert record["file_isolation"] == {"confined": False, "reason": reason}
        assert "run unisolated, as this machine's HETFLOW_ALLOW_UNISOLATED=1 accepts" in done.stderr
        addresses = [replica["address"] for replica in record["replicas"]]
        assert wait_for(lambda: all(map(listening, addresses)), timeout=90), "the replicas never listened here"
    finally:
        teardown_cluster(run_id)
    assert run_processes(run_id) == []

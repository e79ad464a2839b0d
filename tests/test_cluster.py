"""Cluster layout and the local provisioner: real replica processes, failures, no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO
from tasks.cluster.layout import ClusterLayout, Replica, plan_cluster
from tasks.spec import parse_spec


def test_one_device_layout_is_one_worker_on_loopback():
    ports = iter([41001])
    layout = plan_cluster(parse_spec({}), "run-1", pick_port=lambda: next(ports))
    assert layout.replicas == (Replica("worker", 0, "127.0.0.1:41001"),)
    assert json.loads(layout.tf_config(layout.replicas[0])) == {
        "cluster": {"worker": ["127.0.0.1:41001"]},
        "task": {"type": "worker", "index": 0},
    }
    assert ClusterLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout


def _wait_for(predicate, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


@pytest.fixture()
def run_id(hetflow_env, request):
    """A run with a validated spec and prepared data, ready to provision."""
    from tasks import stages

    run = f"test_{request.node.name}_{os.getpid()}"
    stages.validate_spec({"epochs": 1000}, run)
    stages.prepare_data(run)
    stages.provision_cluster(run)
    yield run
    stages.teardown_cluster(run)


def test_a_crashing_replica_fails_the_run_with_its_log_tail(run_id):
    from tasks import stages
    from tasks.cluster.local import ReplicaFailed, run_processes
    from tasks.paths import run_paths

    paths = run_paths(run_id)
    dataset = json.loads(paths.dataset.read_text())
    paths.dataset.write_text(json.dumps({**dataset, "load_name": "uci_digits:9.9.9"}))
    with pytest.raises(ReplicaFailed, match=r"replica worker-0 exited with code 1; last output: .*uci_digits") as caught:
        stages.train(run_id)
    assert "9.9.9" in str(caught.value)
    assert "Traceback" in (paths.logs / "worker-0.log").read_text()
    assert run_processes(run_id) == []


_SUPERVISOR = textwrap.dedent(
    """
    import sys
    from tasks import stages
    stages.train(sys.argv[1])
    """
)


def test_killing_the_supervisor_ends_its_replicas(run_id, hetflow_env):
    from tasks.cluster.local import run_processes
    from tasks.paths import run_paths

    supervisor = subprocess.Popen([sys.executable, "-c", _SUPERVISOR, run_id], cwd=REPO, env=hetflow_env)
    try:
        log = run_paths(run_id).logs / "worker-0.log"
        assert _wait_for(lambda: log.exists() and "Epoch 1/" in log.read_text(), timeout=120), "replica never trained"
        replicas = run_processes(run_id)
        assert len(replicas) == 1
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(timeout=10)
        assert _wait_for(lambda: run_processes(run_id) == [], timeout=10), "replica outlived its supervisor"
    finally:
        supervisor.kill()


def test_teardown_ends_a_replica_that_ignores_sigterm(hetflow_env):
    from tasks.cluster.local import RUN_ID_ENV, run_processes, teardown_run

    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(600)",
        ],
        env={**hetflow_env, RUN_ID_ENV: "stubborn-run"},
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert stubborn.stdout.readline() == b"ready\n"
        assert run_processes("stubborn-run") == [stubborn.pid]
        started = time.monotonic()
        assert teardown_run("stubborn-run") == [stubborn.pid]
        assert time.monotonic() - started >= 5  # SIGTERM was ignored: it took the escalation to SIGKILL
        stubborn.wait(timeout=5)  # (teardown reaped it, so its exit status is not ours to read)
        assert run_processes("stubborn-run") == []
    finally:
        stubborn.kill()

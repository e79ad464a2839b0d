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
from conftest import REPO, replica_listening, wait_for

from hetflow.cluster.layout import ClusterLayout, Replica, plan_cluster
from hetflow.cluster.processes import run_replicas
from hetflow.spec import parse_spec


def test_one_device_layout_is_one_worker_on_loopback():
    ports = iter([41001])
    layout = plan_cluster(parse_spec({}), "run-1", pick_port=lambda: next(ports))
    assert layout.replicas == (Replica("worker", 0, "127.0.0.1:41001"),)
    assert json.loads(layout.tf_config(layout.replicas[0])) == {
        "cluster": {"worker": ["127.0.0.1:41001"]},
        "task": {"type": "worker", "index": 0},
    }
    assert ClusterLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout


@pytest.fixture()
def run_id(provisioned):
    return provisioned()


@pytest.mark.replicas
def test_a_crashing_replica_fails_the_run_with_its_log_tail(run_id):
    from hetflow.cluster.processes import run_processes
    from hetflow.cluster.supervisor import ReplicaFailed
    from hetflow.paths import run_paths
    from hetflow.records import DatasetRecord
    from hetflow.tasks.train import train

    paths = run_paths(run_id)
    dataset = DatasetRecord.read(paths)
    dataset.model_copy(update={"prepared_dir": dataset.prepared_dir.replace("1.0.0", "9.9.9")}).write(paths)
    with pytest.raises(ReplicaFailed, match=r"replica worker-0 exited with code 1; last output: .*") as caught:
        train(run_id)
    assert "9.9.9" in str(caught.value)
    assert "Traceback" in (paths.logs / "worker-0.log").read_text()
    assert run_processes(run_id) == []


_SUPERVISOR = textwrap.dedent(
    """
    import sys
    from hetflow.tasks.train import train
    train(sys.argv[1])
    """
)


def _train_until_worker_1_epoch_2(run_id: str, env: dict) -> subprocess.Popen:
    """The train stage of a 2-worker sync run, in a process of its own, once worker-1 logs epoch 2."""
    from hetflow.paths import run_paths

    supervisor = subprocess.Popen(
        [sys.executable, "-c", _SUPERVISOR, run_id], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
    )
    log = run_paths(run_id).logs / "worker-1.log"
    if not wait_for(lambda: log.exists() and "Epoch 2/" in log.read_text(), timeout=120):
        supervisor.kill()
        raise AssertionError("never trained")
    return supervisor


@pytest.mark.replicas
def test_killing_the_supervisor_ends_its_replicas(run_id, hetflow_env):
    from hetflow.cluster.processes import run_processes
    from hetflow.paths import run_paths

    supervisor = subprocess.Popen([sys.executable, "-c", _SUPERVISOR, run_id], cwd=REPO, env=hetflow_env)
    try:
        log = run_paths(run_id).logs / "worker-0.log"
        assert wait_for(lambda: log.exists() and "Epoch 1/" in log.read_text(), timeout=120), "replica never trained"
        assert list(run_replicas(run_id)) == ["worker-0"]
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(timeout=10)
        assert wait_for(lambda: run_processes(run_id) == [], timeout=10), "replica outlived its supervisor"
    finally:
        supervisor.kill()


@pytest.mark.replicas
def test_sigterm_of_the_train_task_ends_its_replicas_and_namespace_within_airflows_grace(provisioned, hetflow_env):
    """Airflow 3 stops a task with SIGTERM and SIGKILLs it 5 s later: the train stage must have
    stopped its replicas (TF ignores SIGTERM) by then, leaving no process in the run's network namespace."""
    from hetflow.cluster.processes import run_processes

    run_id = provisioned(strategy="multi_worker_mirrored", workers=2)
    supervisor = _train_until_worker_1_epoch_2(run_id, hetflow_env)
    try:
        supervisor.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _, stderr = supervisor.communicate(timeout=30)
        assert time.monotonic() - started < 5, "the task would have been SIGKILLed before it stopped its replicas"
        assert supervisor.returncode != 0 and "Interrupted: stopped by SIGTERM" in stderr
        assert run_processes(run_id) == []
        # Nor is anything left in the run's network namespace (its sandboxes die with their bwrap).
        assert wait_for(lambda: run_replicas(run_id) == {}, timeout=5)
    finally:
        supervisor.kill()


@pytest.mark.replicas
def test_stopping_the_stack_ends_replicas_no_task_supervises_yet(provisioned, hetflow_env, tmp_path):
    """Between provision_cluster and train the keepers have no supervisor: ``make down`` ends them
    (else they would wait out the attach timeout); a run under another HETFLOW_HOME is left alone."""
    from hetflow.cluster.processes import RUN_ID_ENV, run_processes, teardown_runs_of_home
    from hetflow.paths import hetflow_home

    run_id = provisioned()
    assert wait_for(lambda: list(run_replicas(run_id)) == ["worker-0"], timeout=30)
    other_home = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**hetflow_env, "HETFLOW_HOME": str(tmp_path), RUN_ID_ENV: "other-home-run"},
        start_new_session=True,
    )
    try:
        ours = run_processes(run_id)  # the keepers of the replica and of the network holder, their bwraps
        ended = teardown_runs_of_home(hetflow_home())
        assert set(run_processes(run_id)) == set() and sorted(ended) == sorted(ours) and len(ours) >= 2
        assert run_processes("other-home-run", home=tmp_path) == [other_home.pid]
    finally:
        other_home.kill()


def test_teardown_ends_a_replica_that_ignores_sigterm(hetflow_env):
    from hetflow.cluster.processes import RUN_ID_ENV, run_processes, teardown_run

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


def test_a_child_killed_after_the_grace_is_reaped_not_left_a_zombie():
    """stop_process_groups SIGKILLs what ignored SIGTERM; a child of the caller (a keeper the task
    started) is reaped before it returns, not left <defunct> until the task's process exits."""
    from hetflow.cluster.processes import stop_process_groups

    ignores_term = "\n".join(
        ["import signal, time", "signal.signal(signal.SIGTERM, signal.SIG_IGN)", "print(flush=True)", "time.sleep(60)"]
    )
    for _ in range(3):  # a SIGKILLed child is not always dead yet when a non-waiting reap looks
        child = subprocess.Popen(
            [sys.executable, "-c", ignores_term], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        child.stdout.readline()
        stop_process_groups([child.pid], grace=0.3)
        assert not os.path.exists(f"/proc/{child.pid}"), f"pid {child.pid} left <defunct>"
        child.stdout.close()


@pytest.mark.replicas
def test_a_worker_killed_mid_training_fails_the_sync_run_and_leaves_nothing(provisioned, hetflow_env):
    from hetflow.cluster.processes import run_processes
    from hetflow.paths import run_paths

    run_id = provisioned(strategy="multi_worker_mirrored", workers=2)
    supervisor = _train_until_worker_1_epoch_2(run_id, hetflow_env)
    try:
        os.kill(run_replicas(run_id)["worker-1"], signal.SIGKILL)
        _, stderr = supervisor.communicate(timeout=60)
        assert supervisor.returncode != 0
        assert "ReplicaFailed: replica worker-" in stderr
        assert run_processes(run_id) == []
        layout = json.loads(run_paths(run_id).cluster.read_text())
        assert wait_for(lambda: not any(replica_listening(layout, r["address"]) for r in layout["replicas"]), timeout=5)
    finally:
        supervisor.kill()


@pytest.mark.replicas
def test_killing_the_supervisor_ends_servers_and_chief_of_a_parameter_server_run(provisioned, hetflow_env):
    from hetflow.cluster.processes import run_processes
    from hetflow.paths import run_paths

    run_id = provisioned(strategy="parameter_server", workers=2, ps=1)
    supervisor = subprocess.Popen([sys.executable, "-c", _SUPERVISOR, run_id], cwd=REPO, env=hetflow_env)
    try:
        log = run_paths(run_id).logs / "chief-0.log"
        assert wait_for(lambda: log.exists() and "Epoch 1/" in log.read_text(), timeout=120), "never trained"
        assert sorted(run_replicas(run_id)) == ["chief-0", "ps-0", "worker-0", "worker-1"]
        layout = json.loads(run_paths(run_id).cluster.read_text())
        assert all(replica_listening(layout, r["address"]) for r in layout["replicas"] if r["role"] != "chief")
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(timeout=10)
        assert wait_for(lambda: run_processes(run_id) == [], timeout=10), "replicas outlived their supervisor"
        # (a killed process leaves /proc's view of it before the kernel has closed its sockets)
        assert wait_for(lambda: not any(replica_listening(layout, r["address"]) for r in layout["replicas"]), timeout=5)
    finally:
        supervisor.kill()


def test_parameter_server_layout_and_core_pinning():
    from hetflow.cluster.layout import core_assignment

    ports = iter(range(42000, 42010))
    spec = parse_spec({"strategy": "parameter_server", "workers": 2, "ps": 1})
    layout = plan_cluster(spec, "run-ps", pick_port=lambda: next(ports))
    assert [(r.name, r.serves_until_stopped) for r in layout.replicas] == [
        ("chief-0", False),
        ("worker-0", True),
        ("worker-1", True),
        ("ps-0", True),
    ]
    assert layout.cluster_spec() == {
        "chief": ["127.0.0.1:42000"],
        "worker": ["127.0.0.1:42001", "127.0.0.1:42002"],
        "ps": ["127.0.0.1:42003"],
    }
    cores = sorted(os.sched_getaffinity(0))
    pinned = core_assignment(layout)
    assert pinned["worker-0"] == cores[0] and pinned["worker-1"] == cores[1 % len(cores)]


def test_ports_are_distinct_even_when_the_os_repeats_one():
    ports = iter([43000, 43000, 43001])
    spec = parse_spec({"strategy": "multi_worker_mirrored", "workers": 2})
    layout = plan_cluster(spec, "run-mw", pick_port=lambda: next(ports))
    assert [r.address for r in layout.replicas] == ["127.0.0.1:43000", "127.0.0.1:43001"]


@pytest.mark.replicas
def test_a_run_past_its_timeout_is_stopped_and_fails(provisioned):
    from hetflow.cluster.processes import run_processes
    from hetflow.cluster.supervisor import ReplicaFailed
    from hetflow.tasks.train import train

    run_id = provisioned(strategy="multi_worker_mirrored", workers=2, train_timeout_seconds=10)
    started = time.monotonic()
    with pytest.raises(
        ReplicaFailed, match=r"training timed out after 10 s \(train_timeout_seconds\); stopped worker-0, worker-1"
    ):
        train(run_id)
    assert time.monotonic() - started < 30
    assert run_processes(run_id) == []

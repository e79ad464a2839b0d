"""The DAG run's MLflow run while it runs: made RUNNING by the first stage, its curves and the
replicas' CPU and memory growing while two real workers train. A run failing in train ends FAILED
naming it: tests/test_e2e_run.py (through the DAG) and tests/test_e2e_ui_mlflow.py (its curve kept)."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from hetflow.paths import run_paths

pytestmark = pytest.mark.slow

EPOCHS = 20
AIRFLOW_PAGE = "http://127.0.0.1:8080/dags/hetflow_train/runs/live-run"


def history(client, run_id: str, name: str) -> list:
    return sorted(client.get_metric_history(run_id, name), key=lambda metric: metric.step)


def test_curves_and_usage_grow_in_mlflow_while_two_workers_train(hetflow_env):
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.provision_cluster import provision_cluster
    from hetflow.tasks.teardown_cluster import teardown_cluster
    from hetflow.tasks.train import train
    from hetflow.tasks.validate_spec import validate_spec
    from mlflow import MlflowClient

    client = MlflowClient(hetflow_env["MLFLOW_TRACKING_URI"])
    run = f"live-run-{os.getpid()}"
    values = {"epochs": EPOCHS, "strategy": "multi_worker_mirrored", "workers": 2, "skip_unchanged": False}
    validate_spec(values, run, dag_id="hetflow_train", airflow_url=AIRFLOW_PAGE)
    paths = run_paths(run)
    mlflow_run_id = json.loads(paths.tracking.read_text())["mlflow_run_id"]
    started = client.get_run(mlflow_run_id)
    assert started.info.status == "RUNNING" and started.data.tags["airflow.url"] == AIRFLOW_PAGE
    assert started.data.params["epochs"] == str(EPOCHS) and started.data.params["workers"] == "2"
    assert started.data.tags["airflow.run_id"] == run

    prepare_data(run)
    try:
        provision_cluster(run)
        outcome = {}
        trainer = threading.Thread(target=lambda: outcome.setdefault("record", train(run)))
        trainer.start()
        seen_while_training = set()
        while trainer.is_alive():
            seen_while_training.add(len(history(client, mlflow_run_id, "val_accuracy")))
            time.sleep(0.5)
        trainer.join()
    finally:
        teardown_cluster(run)
    training = outcome["record"]
    assert training["epochs_done"] == EPOCHS
    # Points came while training went on: some, not yet all.
    assert any(0 < count < EPOCHS for count in seen_while_training), seen_while_training
    curve = history(client, mlflow_run_id, "val_accuracy")
    assert [m.step for m in curve] == list(range(1, EPOCHS + 1))
    # Logged as the shortest decimal of their float32: the same float32 as the record's.
    np.testing.assert_array_equal(np.float32([m.value for m in curve]), np.float32(training["history"]["val_accuracy"]))
    for worker in ("worker-0", "worker-1"):
        speeds = history(client, mlflow_run_id, f"epoch_examples_per_second/{worker}")
        assert len(speeds) == EPOCHS and all(m.value > 0 for m in speeds)
        memory = history(client, mlflow_run_id, f"system/memory_mb_{worker}")
        # A TensorFlow process, resident (the first sample, as training starts, may find it still importing).
        assert memory and all(0 < m.value < 8000 for m in memory) and max(m.value for m in memory) > 100
        cpu = history(client, mlflow_run_id, f"system/cpu_percent_{worker}")
        assert cpu and max(m.value for m in cpu) > 5 and all(m.value <= 100 * os.cpu_count() * 1.5 for m in cpu)


def test_a_tracking_server_that_does_not_answer_costs_the_first_stage_seconds_not_minutes(
    hetflow_env, monkeypatch, caplog
):
    """MLflow's client retries for minutes before it gives up (247 s against a closed port here):
    the live calls look once, warn and go on; register later keeps MLflow's own retries."""
    import socket

    from hetflow.registry import live
    from hetflow.tasks.validate_spec import validate_spec

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed}")
    run = f"live-unreachable-{os.getpid()}"
    started = time.monotonic()
    validate_spec({"epochs": 2}, run, dag_id="hetflow_train", airflow_url=AIRFLOW_PAGE)
    assert time.monotonic() - started < live.REACHABLE_SECONDS + 10
    assert not run_paths(run).tracking.exists()
    assert any("did not answer" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)

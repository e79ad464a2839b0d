"""Every strategy through the real DAG (Airflow dag.test, replicas on 127.0.0.1, MLflow); the
learning-rate schedule they share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import NO_COMPRESSION, dag_run, full_log, replica_listening

from hetflow.paths import RunPaths
from hetflow.spec import parse_spec

CASES = {
    "mirrored": ["strategy=mirrored", "devices_per_worker=2"],
    "multi_worker_mirrored": [
        "strategy=multi_worker_mirrored",
        "workers=2",
        "lr_scaling=linear",
        "lr_reference_batch=16",
        "warmup_epochs=1",
    ],
    "parameter_server": ["strategy=parameter_server", "workers=2", "ps=2"],
}  # model_parallel goes through the DAG in test_e2e_run (second run) and test_cluster_docker_runs


@pytest.fixture(scope="module")
def client(hetflow_env):
    from mlflow import MlflowClient

    return MlflowClient(hetflow_env["MLFLOW_TRACKING_URI"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    # parameter_server through the DAG in make test: the trigger form's run (test_e2e_ui_airflow.py)
    # and the docker backend's; its staleness histogram here in make test-all. mirrored's replica
    # trains in make test (test_replica_distributed.py); through the DAG in make test-all.
    [name if name == "multi_worker_mirrored" else pytest.param(name, marks=pytest.mark.heavy) for name in CASES],
)
def test_strategy_trains_through_the_dag(strategy, hetflow_env, client):
    from hetflow.cluster.processes import run_processes

    model = f"registered_model=strategies-{strategy.replace('_', '-')}"
    done, summary = dag_run(hetflow_env, model, "epochs=6", *CASES[strategy], *NO_COMPRESSION)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert summary["status"] == "success" and summary["spec"]["cluster"]["strategy"] == strategy
    assert summary["metrics"]["test_accuracy"] >= 0.85  # 6 short epochs; `make run`-sized runs reach >= 0.9

    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["strategy"] == strategy and run.data.tags["strategy"] == strategy
    training = json.loads(RunPaths(Path(summary["run_dir"])).training.read_text())
    workers = sorted(training["per_worker"])
    # Sync workers gather their shares from the whole split as tensors; async ones read it cached.
    mode = "cached" if strategy == "parameter_server" else "whole_split_tensors"
    assert training["training_input"]["mode"] == mode and training["training_input"]["shuffle_buffer"] == 1258
    for worker in workers:
        key = worker.replace("-", "_")
        assert run.data.metrics[f"{key}_examples_per_second"] > 0
        assert run.data.metrics[f"{key}_step_seconds"] > 0
    assert len(client.get_metric_history(run.info.run_id, "learning_rate")) == 6
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/training_curves.png", "plots/worker_throughput.png"} <= artifacts
    replica_logs = {a.path for a in client.list_artifacts(run.info.run_id, "logs")}
    cluster = json.loads((Path(summary["run_dir"]) / "cluster.json").read_text())
    assert replica_logs == {f"logs/{r['role']}-{r['index']}.log" for r in cluster["replicas"]}

    if strategy == "multi_worker_mirrored":
        assert workers == ["worker-0", "worker-1"]
        lr = [
            m.value for m in sorted(client.get_metric_history(run.info.run_id, "learning_rate"), key=lambda m: m.step)
        ]
        # Global batch 32, twice the reference 16: the rate doubles over 1 warmup epoch.
        assert lr[0] == pytest.approx(0.001) and lr[1:] == pytest.approx([0.002] * 5)
    if strategy == "parameter_server":
        assert workers == ["worker-0", "worker-1"]
        # Two workers update concurrently: some gradients are computed on parameters the other changed.
        assert run.data.metrics["staleness_max"] >= run.data.metrics["staleness_mean"] > 0
        histogram = client.get_metric_history(run.info.run_id, "staleness_updates")
        assert sum(m.value for m in histogram) == training["epochs"] * training["steps_per_epoch"]
        assert "plots/staleness.png" in artifacts
        assert "[ps-1]" in full_log(done) and "[chief-0] Epoch 6/6" in done.stdout

    assert run_processes(summary["run_id"]) == []
    assert not any(replica_listening(cluster, r["address"]) for r in cluster["replicas"])


GOYAL = {"learning_rate": 0.1, "lr_scaling": "linear", "lr_reference_batch": 256, "batch_size": 1024, "epochs": 4}


def test_linear_scaling_multiplies_the_base_rate_by_global_over_reference_batch():
    from hetflow.replica.loop import EpochLoop
    from hetflow.replica.record import training_record

    spec = parse_spec({**GOYAL, "strategy": "multi_worker_mirrored", "workers": 2, "warmup_epochs": 2})
    loop = EpochLoop(spec, steps=10)
    # 0.1 tuned for 256 examples, 1024 per update: 0.4, reached linearly over 2 epochs of 10 steps.
    assert [float(loop.schedule(step)) for step in (0, 5, 10, 20, 1000)] == pytest.approx([0.1, 0.175, 0.25, 0.4, 0.4])
    assert loop.lr_per_epoch == pytest.approx([0.1, 0.25, 0.4, 0.4])
    loop.train_seconds = 1.0
    record = training_record(spec, loop, replicas_in_sync=2, per_worker={})
    assert record["learning_rate_per_epoch"] == pytest.approx([0.1, 0.25, 0.4, 0.4])
    assert record["learning_rate_schedule"] == {
        "scaling": "linear",
        "base": 0.1,
        "reference_batch": 256,
        "global_batch": 1024,
        "peak": pytest.approx(0.4),
        "warmup_steps": 20,
    }


@pytest.mark.parametrize(("global_batch", "peak"), [(128, 0.05), (256, 0.1), (512, 0.2), (1024, 0.4)])
def test_the_rate_is_proportional_to_the_global_batch(global_batch, peak):
    from hetflow.models.schedule import learning_rate

    spec = parse_spec({**GOYAL, "strategy": "multi_worker_mirrored", "workers": 2, "batch_size": global_batch})
    assert learning_rate(spec, 10)[1] == pytest.approx([peak] * 4)


@pytest.mark.parametrize(
    "cluster",
    [
        {"strategy": "one_device"},
        {"strategy": "mirrored", "devices_per_worker": 2},
        {"strategy": "multi_worker_mirrored", "workers": 4},
        {"strategy": "parameter_server", "workers": 3, "ps": 1},
    ],
)
def test_replicas_sharing_the_same_global_batch_get_the_same_rate(cluster):
    from hetflow.models.schedule import learning_rate

    spec = parse_spec({**GOYAL, **cluster})
    schedule, per_epoch = learning_rate(spec, 10)
    assert float(schedule(0)) == pytest.approx(0.4) and per_epoch == pytest.approx([0.4] * 4)


def test_without_scaling_the_rate_is_the_base_rate_whatever_the_batch():
    from hetflow.models.schedule import learning_rate, learning_rate_plan

    spec = parse_spec({**GOYAL, "lr_scaling": "none", "warmup_epochs": 1})
    assert learning_rate(spec, 10)[1] == pytest.approx([0.1] * 4)
    plan = learning_rate_plan(spec, 10)
    assert (plan["base"], plan["peak"], plan["reference_batch"], plan["warmup_steps"]) == (0.1, 0.1, None, 10)


def test_a_served_replica_computes_with_the_threads_its_worker_devices_entry_gives():
    """A stage or a parameter_server worker runs the chief's functions in its TF server's pools,
    which the process-wide settings do not reach: the server is given them."""
    from hetflow.replica.runtime import replica_threads, server_config

    spec = parse_spec({"strategy": "model_parallel", "workers": 2, "worker_devices": [{"threads": 1}, {"threads": 3}]})
    stage_threads = [replica_threads(spec, {"type": "worker", "index": i}) for i in (0, 1)]
    configs = [server_config(threads) for threads in stage_threads]
    assert [(c.intra_op_parallelism_threads, c.inter_op_parallelism_threads) for c in configs] == [(1, 2), (3, 3)]
    default = server_config(
        replica_threads(parse_spec({"strategy": "parameter_server", "workers": 2, "ps": 1}), {"type": "ps", "index": 0})
    )
    assert default.intra_op_parallelism_threads == 0  # TensorFlow's default: one per core

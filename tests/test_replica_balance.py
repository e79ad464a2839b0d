"""Heterogeneous clusters: throttled workers, probes, balanced sync, strategy=auto, target accuracy."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import NO_COMPRESSION, dag_run, hetflow

from hetflow.paths import RunPaths
from hetflow.replica.auto_strategy import ASYNC_SPREAD, Probe, decide
from hetflow.replica.batch_shares import split_batch
from hetflow.spec import parse_spec

SLOW_WORKER = '[{"threads": 1}, {"threads": 1, "slowdown": 3}]'


def _probe(worker: int, speed: float, step_seconds: float) -> Probe:
    return Probe(
        worker=f"worker-{worker}",
        examples_per_second=speed,
        step_seconds=step_seconds,
        batch=32,
        steps=10,
        model_parameters=1_116_970,
    )


def _spec(**values):
    return parse_spec({"strategy": "auto", "workers": 2, "batch_size": 64, **values})


def test_split_batch_is_proportional_and_exact():
    assert split_batch(64, [800, 400]) == [43, 21]
    assert split_batch(64, [1, 1]) == [32, 32]
    assert split_batch(10, [100, 1, 1]) == [8, 1, 1]
    for speeds in ([3, 7], [1, 2, 3], [5, 5, 1]):
        assert sum(split_batch(31, speeds)) == 31


def test_auto_keeps_short_steps_on_one_device():
    decision = decide(_spec(), [_probe(0, 9000, 0.004), _probe(1, 8800, 0.004)])
    assert decision.strategy == "one_device" and decision.settings["workers"] == 1
    assert "steps under 20 ms" in decision.reason


def test_auto_uses_sync_with_equal_shares_for_an_even_cluster():
    decision = decide(_spec(), [_probe(0, 700, 0.09), _probe(1, 680, 0.094)])
    settings = {"strategy": "multi_worker_mirrored", "ps": 0, "balance_batches": False}
    assert decision.settings == settings
    assert "spread 1.03x" in decision.reason


def test_auto_balances_a_worker_twice_as_slow():
    decision = decide(_spec(), [_probe(0, 700, 0.09), _probe(1, 350, 0.18)])
    assert decision.settings["balance_batches"] is True
    assert "per-worker batches 43/21 (global 64)" in decision.reason


def test_auto_goes_async_beyond_the_async_spread():
    decision = decide(_spec(), [_probe(0, 1000, 0.03), _probe(1, 1000 / (ASYNC_SPREAD + 1), 0.15)])
    assert decision.settings == {"strategy": "parameter_server", "ps": 1, "batch_size": 32}


def test_visible_gpus_give_each_gpu_worker_its_own_devices():
    from hetflow.cluster.backends.local.replicas import visible_gpus
    from hetflow.cluster.layout import plan_cluster

    spec = parse_spec(
        {
            "strategy": "multi_worker_mirrored",
            "workers": 3,
            "batch_size": 60,
            "worker_devices": [{"device": "gpu", "count": 2}, {"device": "cpu"}, {"device": "gpu"}],
        }
    )
    assert visible_gpus(plan_cluster(spec, "r"), spec) == {"worker-0": "0,1", "worker-1": "", "worker-2": "2"}


def test_unequal_worker_slices_are_the_global_batch_and_each_worker_batches_only_its_own(tmp_path):
    import tensorflow as tf

    from hetflow.data.pipeline import train_input, train_slices, training_tensors
    from hetflow.data.prepare import prepare_dataset

    dataset = prepare_dataset("uci_digits", tmp_path)
    steps, offsets = 4, [0, 5, 7, 8]  # shares 5, 2 and 1 of a global batch of 8
    whole = train_input(dataset, per_worker_batch=8, shuffle=True, seed=7).take(steps)
    single = [(images.numpy(), labels.numpy()) for images, labels in whole]
    slices = [
        train_slices(training_tensors(dataset), start=start, end=end, global_batch=8, shuffle=True, seed=7)
        for start, end in zip(offsets, offsets[1:])
    ]
    parts = [[(images.numpy(), labels.numpy()) for images, labels in pipeline.take(steps)] for pipeline in slices]
    for step in range(steps):
        assert [len(worker[step][1]) for worker in parts] == [5, 2, 1]
        for field in (0, 1):  # images, labels
            union = np.concatenate([worker[step][field] for worker in parts])
            np.testing.assert_array_equal(union, single[step][field])
    with pytest.raises(ValueError, match="not a slice"):
        train_slices(training_tensors(dataset), start=3, end=3, global_batch=8, shuffle=True, seed=7)
    # Each worker reads only its own share: the one batch its pipeline forms is of example indices
    # (the global batch's positions); the examples it gathers are its share. tf.data has no public
    # view of a pipeline's graph.
    for pipeline, share in zip(slices, [5, 2, 1]):
        graph = tf.compat.v1.GraphDef.FromString(pipeline._as_serialized_graph().numpy())
        batches = [node for node in graph.node if node.op.startswith("BatchDataset")]
        assert [[tf.as_dtype(t) for t in b.attr["output_types"].list.type] for b in batches] == [[tf.int64]]


def test_the_workers_are_measured_over_the_same_seconds_each_on_its_own_computation(monkeypatch):
    import time

    from hetflow.replica import balance

    monkeypatch.setattr(balance, "MEASURE_SECONDS", 0.3)
    # Two workers in one process: worker 0's steps take 10 ms here; worker 1's part of the sums is
    # what a worker four times slower would have measured over the same seconds.
    sums = []

    def sum_over_workers(slots):
        sums.append(slots)
        if len(slots) == 1:
            return slots  # the start barrier
        return [slots[0], slots[1], slots[0], slots[1] / 4]

    computed = []

    def compute(step):
        computed.append(step)
        time.sleep(0.01)

    probes = balance.measure_workers(compute, ((step,) for step in range(10_000)), 64, 0, 2, 1000, sum_over_workers)
    measured_steps = len(computed) - balance.WARMUP_STEPS
    assert sums[0] == [0.0] and sums[1][1] == measured_steps  # warm-up steps are not counted
    assert 0.3 <= sums[1][0] < 0.5 and 15 <= measured_steps <= 30
    assert 64 / 0.02 <= probes[0].examples_per_second <= 64 / 0.01  # steps of 10 ms and a little more
    assert probes[0].examples_per_second == pytest.approx(4 * probes[1].examples_per_second)
    assert [p.batch for p in probes] == [64, 64] and [p.worker for p in probes] == ["worker-0", "worker-1"]


def test_throttle_limits_cpu_time_from_outside():
    from hetflow.cluster.backends.local.throttle import Throttle

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    throttle = Throttle(busy.pid, slowdown=4)
    try:
        throttle.start()
        started_cpu, started = _cpu_seconds(busy.pid), time.monotonic()
        time.sleep(2.0)
        share = (_cpu_seconds(busy.pid) - started_cpu) / (time.monotonic() - started)
        # At most 1/4 of the CPU time (clock ticks and scheduling give or take); on a busy machine the
        # process may get less than its quota (0.21 seen under load), never more.
        assert 0.17 <= share <= 0.28
    finally:
        throttle.stop()
        busy.kill()
        busy.wait()


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def _train(env, *sets: str) -> tuple[dict, object]:
    args = ["train"]
    for assignment in sets:
        args += ["--set", assignment]
    done = hetflow(env, *args)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    from pathlib import Path

    record = Path(done.stdout.strip().splitlines()[-1])
    return json.loads(record.read_text()), record.parents[1]  # the run directory: training.json is in its output


@pytest.mark.slow
def test_balanced_update_on_unequal_shards_equals_the_single_replica_update(hetflow_env):
    from hetflow.models.architectures import build_model, read_weights
    from hetflow.paths import RunPaths

    same = ["optimizer=sgd", "learning_rate=0.1", "shuffle=false", "epochs=1", "steps_per_epoch=8", "batch_size=32"]
    single_record, single = _train(hetflow_env, "strategy=one_device", *same)
    record, balanced = _train(
        hetflow_env,
        "strategy=multi_worker_mirrored",
        "workers=2",
        "balance_batches=true",
        f"worker_devices={SLOW_WORKER}",
        *same,
    )
    # The workers measured themselves inside the training processes, before the first step.
    worker_log = (balanced / "logs/worker-1.log").read_text()
    assert worker_log.index("probe worker-1:") < worker_log.index("balanced batches") < worker_log.index("Epoch 1/")
    plan = json.loads(RunPaths(balanced).plan.read_text())
    speeds = [p["examples_per_second"] for p in plan["probes"]]
    assert speeds[0] > 1.5 * speeds[1]  # the throttled worker measured slower
    assert record["worker_batches"] == plan["worker_batches"] and sum(record["worker_batches"]) == 32
    assert record["per_replica_batch"] == record["worker_batches"]
    assert record["worker_batches"][0] > record["worker_batches"][1]
    weights = [
        read_weights(build_model("mlp", [8, 8, 1], 10, 42), RunPaths(d).model).get_weights() for d in (single, balanced)
    ]
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(*weights))
    assert difference <= 1e-5
    # Each worker scored its share of the validation split; the summed metrics are the whole split's.
    for metric in ("loss", "val_loss", "val_accuracy"):
        assert record["history"][metric] == pytest.approx(single_record["history"][metric], abs=1e-4)


@pytest.mark.slow
def test_plain_sync_runs_the_balanced_loop_with_equal_shares_without_probing(hetflow_env):
    """The control for balanced sync: the same loop, the slowed worker given half the batch."""
    record, run_dir = _train(
        hetflow_env,
        "strategy=multi_worker_mirrored",
        "workers=2",
        f"worker_devices={SLOW_WORKER}",
        "epochs=1",
        "batch_size=32",
    )
    assert record["worker_batches"] == [16, 16] and record["per_replica_batch"] == 16
    assert record["balanced"] is False and not RunPaths(run_dir).plan.exists()
    # The digits fit the cache budget: each worker holds and reads the whole split (4 files).
    assert record["training_input"]["mode"] == "whole_split_tensors"
    assert [(part["read_examples"], len(part["read_files"])) for part in record["per_worker"].values()] == [
        (1258, 4),
        (1258, 4),
    ]
    assert "probe worker-1:" not in (run_dir / "logs/worker-1.log").read_text()
    assert "batches [16, 16] of 32; this worker takes 16" in (run_dir / "logs/worker-0.log").read_text()


@pytest.mark.slow
def test_target_accuracy_stops_training_and_times_it(hetflow_env):
    record, _ = _train(hetflow_env, "epochs=60", "target_accuracy=0.9")
    assert record["epochs_done"] < 60
    assert record["history"]["val_accuracy"][-1] >= 0.9 > max(record["history"]["val_accuracy"][:-1], default=0)
    assert 0 < record["seconds_to_target"] <= record["train_seconds"]


@pytest.mark.heavy  # auto's decisions are make test's unit tests above; this is their DAG variant
@pytest.mark.slow
def test_auto_through_the_dag_logs_its_decision(hetflow_env):
    from pathlib import Path

    from mlflow import MlflowClient

    sets = ["strategy=auto", "workers=2", f"worker_devices={SLOW_WORKER}", "epochs=5", "registered_model=auto-digits"]
    done, summary = dag_run(hetflow_env, *sets, *NO_COMPRESSION)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    paths = RunPaths(Path(summary["run_dir"]))
    plan = json.loads(paths.plan.read_text())
    # provision_cluster launched the workers to measure themselves, and from their probes found the
    # digits MLP's steps far under 20 ms (a few ms of computation here): it launched the run on the
    # fastest worker alone. decide() itself is tested on fixed probes above.
    assert (
        [probe["worker"] for probe in plan["probes"]]
        == ["worker-0", "worker-1"]
        == [probe["worker"] for probe in summary["auto"]["probes"]]
    )
    decision = summary["auto"]["decision"]
    assert decision["strategy"] == "one_device", decision
    assert decision["reason"].startswith("auto chose one_device") and decision["reason"] in done.stdout
    assert json.loads(paths.spec.read_text())["cluster"]["strategy"] == "one_device"
    assert json.loads(paths.requested_spec.read_text())["cluster"]["strategy"] == "auto"
    training = json.loads(paths.training.read_text())
    assert training["replicas_in_sync"] == 1 and training["epochs_done"] == 5
    assert summary["auto"]["requested"] == "auto"
    run = MlflowClient(hetflow_env["MLFLOW_TRACKING_URI"]).get_run(summary["mlflow_run_id"])
    assert run.data.params["requested_strategy"] == "auto"
    assert run.data.params["strategy"] == "one_device" == summary["spec"]["cluster"]["strategy"]
    assert run.data.tags["auto.decision"] == decision["reason"]
    assert (
        run.data.metrics["probe_worker_0_examples_per_second"] > run.data.metrics["probe_worker_1_examples_per_second"]
    )

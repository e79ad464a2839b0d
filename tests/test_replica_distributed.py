"""Distributed training on real replica processes talking gRPC on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import hetflow

pytestmark = pytest.mark.slow


def train(env, *sets: str) -> tuple[dict, Path]:
    """``hetflow train`` with these keys; returns training.json and the run directory."""
    args = ["train"]
    for assignment in sets:
        args += ["--set", assignment]
    done = hetflow(env, *args)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record_path = Path(done.stdout.strip().splitlines()[-1])
    return json.loads(record_path.read_text()), record_path.parents[1]  # training.json is in replica_output/


def model_weights(run_dir: Path) -> list[np.ndarray]:
    """The trained weights, read as every stage reads them: into the MLP rebuilt here."""
    from hetflow.models.architectures import build_model, read_weights
    from hetflow.paths import RunPaths

    return read_weights(build_model("mlp", [8, 8, 1], 10, seed=42), RunPaths(run_dir).model).get_weights()


def test_two_workers_with_half_batches_match_one_worker_with_the_whole_batch(hetflow_env):
    """Sync all-reduce is exact: 2 MWMS workers x batch B/2 == 1 worker x batch B after K steps."""
    same = ["optimizer=sgd", "learning_rate=0.1", "shuffle=false", "epochs=1", "steps_per_epoch=8", "batch_size=32"]
    # Linear scaling by the rule: same global batch, same rate (0.1 x 32 / 16), however many replicas.
    same += ["lr_scaling=linear", "lr_reference_batch=16", "warmup_epochs=0.5"]
    single_record, single = train(hetflow_env, "strategy=one_device", *same)
    record, pair = train(hetflow_env, "strategy=multi_worker_mirrored", "workers=2", *same)
    assert record["replicas_in_sync"] == 2 and record["per_replica_batch"] == 16
    assert record["learning_rate_schedule"] == single_record["learning_rate_schedule"]
    assert record["learning_rate_schedule"]["peak"] == pytest.approx(0.2)
    assert sorted(record["per_worker"]) == ["worker-0", "worker-1"]
    single_weights, pair_weights = model_weights(single), model_weights(pair)
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(single_weights, pair_weights))
    assert difference <= 1e-5
    from hetflow.models.architectures import build_model

    initial = build_model("mlp", [8, 8, 1], 10, seed=42).get_weights()
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(single_weights, initial))
    assert moved > 100 * difference and moved > 1e-3  # training changed the weights; both runs alike


def test_model_parallel_places_layer_groups_and_their_variables_on_different_devices(hetflow_env):
    record, run_dir = train(
        hetflow_env, "strategy=model_parallel", "devices_per_worker=2", "stage_split=parameters", "epochs=2"
    )
    placement = {entry["layer"]: entry for entry in record["layer_placement"]}
    devices = sorted({entry["device"] for entry in placement.values()})
    assert len(devices) == 2 and devices[0].endswith("CPU:0") and devices[1].endswith("CPU:1")
    logits = placement["logits"]
    assert logits["device"] == devices[1] and logits["variables"][0].endswith("CPU:1")
    first_dense = next(e for e in record["layer_placement"] if e["variables"])
    assert first_dense["variables"][0].endswith("CPU:0")
    assert record["history"]["val_accuracy"][-1] > record["history"]["val_accuracy"][0]


def test_model_parallel_across_two_workers_pipelined_takes_the_one_device_steps(hetflow_env):
    """Two stage replicas, three unequal micro-batches (11, 11, 10 of 32): the same weights as one
    device stepping through the whole batch; each stage's variables and slots on its worker."""
    same = ["optimizer=sgd", "learning_rate=0.1", "shuffle=false", "epochs=1", "steps_per_epoch=8", "batch_size=32"]
    _, single = train(hetflow_env, "strategy=one_device", *same)
    # The default split, by measured time: however the layers time, worker-0 must keep dense and worker-1
    # the logits, the one cut that leaves neither without weights (time alone once gave worker-0 none, #58).
    staged_keys = ["strategy=model_parallel", "workers=2", "micro_batches=3"]
    record, staged = train(hetflow_env, *staged_keys, *same)
    assert record["micro_batches"] == 3
    single_weights, staged_weights = model_weights(single), model_weights(staged)
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(single_weights, staged_weights))
    assert difference <= 1e-5
    from hetflow.models.architectures import build_model

    initial = build_model("mlp", [8, 8, 1], 10, seed=42).get_weights()
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(single_weights, initial))
    assert moved > 100 * difference and moved > 1e-3
    # The MLP: 64 inputs -> dense 128 -> logits 10, float32.
    workers = record["per_worker"]
    assert workers["worker-0"]["layers"][-1].startswith("dense") and workers["worker-1"]["layers"] == ["logits"]
    assert workers["worker-0"]["variable_bytes"] == 4 * (64 * 128 + 128)
    assert workers["worker-1"]["variable_bytes"] == 4 * (128 * 10 + 10)
    # Keras's SGD keeps a momentum slot per variable (even at momentum 0), beside its variable.
    assert all(workers[name]["slot_bytes"] == workers[name]["variable_bytes"] for name in workers)
    logits = next(entry for entry in record["layer_placement"] if entry["layer"] == "logits")
    assert logits["variables"] == ["/job:worker/replica:0/task:1/device:CPU:0"]
    from hetflow.models.stage_split import read_stage_split
    from hetflow.paths import RunPaths
    from hetflow.replica.training_json import TrainingRecord
    from hetflow.spec import RunSpec

    paths = RunPaths(staged)
    trained = TrainingRecord.model_validate(record)
    split = read_stage_split(paths.plan, RunSpec.from_json(paths.spec.read_text()), trained)
    assert [stage.layers for stage in split.stages] == [workers["worker-0"]["layers"], ["logits"]]


def test_parameter_server_shards_variables_measures_staleness_per_worker_and_communication(hetflow_env):
    record, _ = train(hetflow_env, "strategy=parameter_server", "workers=2", "ps=2", "epochs=2", "steps_per_epoch=300")
    from hetflow.models.architectures import build_model

    model = build_model("mlp", [8, 8, 1], 10, seed=42)
    communication = record["communication"]
    # A step reads every parameter (float32) onto its worker and sends as many bytes of gradient
    # back; the kernel's two shards are two variables of the exchange.
    assert communication["bytes_to_worker"] == communication["bytes_to_ps"] == 4 * model.count_params()
    assert communication["variables"] == len(model.trainable_variables) + 1
    # Timed alone, an exchange takes less than a step of training, which makes the same one.
    step_seconds = min(worker["step_seconds"] for worker in record["per_worker"].values())
    assert 0 < communication["seconds_per_step"] < step_seconds
    shards = record["sharded_variables"]["dense/kernel"]
    assert [s["shape"] for s in shards] == [[32, 128], [32, 128]]  # the 64x128 kernel split over 2 ps
    assert sorted(s["device"].split("/device")[0] for s in shards) == [
        "/job:ps/replica:0/task:0",
        "/job:ps/replica:0/task:1",
    ]
    steps = {name: w["steps"] for name, w in record["per_worker"].items()}
    assert sum(steps.values()) == record["epochs"] * record["steps_per_epoch"] == 600
    assert set(steps) == {"worker-0", "worker-1"}  # both workers took scheduled steps
    staleness = record["staleness"]
    assert sum(staleness["histogram"].values()) == 600
    # Two workers update concurrently: some gradients were computed before the other's update landed.
    assert staleness["mean"] > 0 and any(int(stale) >= 1 for stale in staleness["histogram"])
    assert_staleness_bounded_by_the_other_workers_updates(record)
    assert record["history"]["val_accuracy"][-1] >= 0.85


def assert_staleness_bounded_by_the_other_workers_updates(record: dict) -> None:
    """A worker runs its steps one after another, so the intervals from its reads to its applies do
    not overlap: each update of another worker lands in at most one of them, and the staleness
    summed over one worker's updates is at most the number of the other workers' updates."""
    per_worker = record["per_worker"]
    total_steps = sum(w["steps"] for w in per_worker.values())
    for name, worker in per_worker.items():
        summed = round(worker["staleness_mean"] * worker["steps"])
        assert 0 <= worker["staleness_max"] <= summed <= total_steps - worker["steps"], name


def test_a_slowed_async_worker_computes_its_gradients_on_stale_parameters(hetflow_env):
    """Worker 1 gets a quarter of the CPU time: while it computes one gradient, worker 0 applies
    several updates, so its updates are stale by more than one on average, and more than worker 0's."""
    record, _ = train(
        hetflow_env,
        "strategy=parameter_server",
        "workers=2",
        "ps=1",
        "epochs=1",
        "steps_per_epoch=300",
        'worker_devices=[{"threads": 1}, {"threads": 1, "slowdown": 4}]',
    )
    fast, slow = record["per_worker"]["worker-0"], record["per_worker"]["worker-1"]
    assert fast["steps"] > slow["steps"] > 0
    assert slow["staleness_mean"] > max(1.0, fast["staleness_mean"])
    assert record["staleness"]["mean"] > 0
    assert_staleness_bounded_by_the_other_workers_updates(record)


def test_parameter_server_replicas_pinned_to_a_core_each_train(hetflow_env):
    """Pinned, a server's inter-op pool had one thread and the chief never saw its first epoch."""
    sets = ["strategy=parameter_server", "workers=2", "ps=1", "pin_cores=true", "replica_threads=1"]
    sets += ["epochs=1", "steps_per_epoch=40"]
    done = hetflow(hetflow_env, "train", *[token for key in sets for token in ("--set", key)], timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    pinned = [line for line in done.stderr.splitlines() if "pinned to core" in line]
    for replica in ("chief-0", "worker-0", "worker-1", "ps-0"):
        assert any(f"started {replica} " in line for line in pinned), replica
    record = json.loads(Path(done.stdout.strip().splitlines()[-1]).read_text())
    assert sum(worker["steps"] for worker in record["per_worker"].values()) == 40


def test_one_async_worker_is_never_stale(hetflow_env):
    record, _ = train(hetflow_env, "strategy=parameter_server", "workers=1", "ps=1", "epochs=2", "steps_per_epoch=100")
    assert record["staleness"] == {"mean": 0.0, "max": 0, "histogram": {"0": 200}}


def test_linear_lr_scaling_with_warmup(hetflow_env):
    record, _ = train(
        hetflow_env,
        "strategy=mirrored",
        "devices_per_worker=2",
        "optimizer=sgd",
        "learning_rate=0.05",
        "lr_scaling=linear",
        "lr_reference_batch=16",
        "warmup_epochs=2",
        "epochs=4",
    )
    assert record["replicas_in_sync"] == 2
    # 0.05 tuned for 16 examples, 32 per update: 0.1, reached over 2 epochs.
    assert record["learning_rate_per_epoch"] == pytest.approx([0.05, 0.075, 0.1, 0.1])
    steps = record["steps_per_epoch"]
    assert record["learning_rate_schedule"] == {
        "scaling": "linear",
        "base": 0.05,
        "reference_batch": 16,
        "global_batch": 32,
        "peak": pytest.approx(0.1),
        "warmup_steps": 2 * steps,
    }


def test_the_whole_job_is_timed_from_launch_to_the_weights_written(hetflow_env):
    """training.json's whole-job figures cover the replica's launch to its final weights: inside the
    wall time of the command, after the weights file was written, and split into parts that each
    took time where time must go (start-up imports TensorFlow; every epoch validates)."""
    import time

    from hetflow.paths import RunPaths

    before = time.time()
    record, run_dir = train(hetflow_env, "strategy=multi_worker_mirrored", "workers=2", "epochs=2")
    after = time.time()
    assert before < record["launched_at"] < record["weights_written_at"] < after
    assert RunPaths(run_dir).model.stat().st_mtime <= record["weights_written_at"]
    assert record["whole_job_seconds"] == pytest.approx(record["weights_written_at"] - record["launched_at"])
    examples = 2 * record["steps_per_epoch"] * record["global_batch"]
    assert record["whole_job_examples_per_second"] == pytest.approx(examples / record["whole_job_seconds"])
    parts = record["whole_job_breakdown"]
    assert list(parts) == ["start_up", "first_step", "steps", "validation", "between_epochs", "shutdown"]
    assert all(seconds >= 0 for seconds in parts.values()), parts
    assert parts["start_up"] > 1.0  # a process that imports TensorFlow and joins a cluster
    assert len(record["validation_seconds"]) == 2 and parts["validation"] == pytest.approx(
        sum(record["validation_seconds"])
    )
    assert sum(parts.values()) == pytest.approx(record["whole_job_seconds"])
    assert record["whole_job_seconds"] > sum(record["epoch_seconds"]) + parts["start_up"]

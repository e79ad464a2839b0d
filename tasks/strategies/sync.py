"""Synchronous data-parallel training with ``model.fit``: one_device, mirrored, multi_worker_mirrored.

``model.fit`` serves sync training best: Keras all-reduces the gradients, scales the loss by the
global batch and aggregates metrics over replicas itself, and prints per-epoch progress. (tf_keras
is required: Keras 3's fit fails under MultiWorkerMirroredStrategy on TF 2.21.)
"""

from __future__ import annotations

import time
from typing import Any

import tensorflow as tf

from tasks.data.pipeline import eval_input, train_input
from tasks.models import build_model, compile_model
from tasks.paths import RunPaths
from tasks.spec import RunSpec
from tasks.strategies.common import (
    TrainingClock,
    learning_rate,
    local_devices,
    make_optimizer,
    save_model,
    steps_per_epoch,
    training_record,
    worker_rate,
    write_training_record,
)


def make_strategy(spec: RunSpec) -> tf.distribute.Strategy:
    if spec.strategy == "one_device":
        # The default strategy: one device, and (unlike OneDeviceStrategy) BackupAndRestore works with it.
        return tf.distribute.get_strategy()
    if spec.strategy == "mirrored":
        return tf.distribute.MirroredStrategy(local_devices(spec.worker_device(0).count))
    # Ring all-reduce over gRPC between the workers named in TF_CONFIG (no NCCL on CPU).
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def is_chief(task: dict[str, Any]) -> bool:
    return task["type"] == "worker" and task["index"] == 0


def train(spec: RunSpec, dataset: dict[str, Any], paths: RunPaths, task: dict[str, Any]) -> None:
    strategy = make_strategy(spec)
    replicas = strategy.num_replicas_in_sync
    steps = steps_per_epoch(spec, dataset)
    schedule, lr_per_epoch = learning_rate(spec, steps)
    with strategy.scope():
        model = build_model(spec.model, dataset["input_shape"], dataset["num_classes"], spec.seed)
        compile_model(model, make_optimizer(spec, schedule))

    def worker_batches(context: tf.distribute.InputContext) -> tf.data.Dataset:
        return train_input(
            dataset,
            per_worker_batch=context.get_per_replica_batch_size(spec.batch_size),
            shuffle=spec.shuffle,
            seed=spec.seed,
            num_workers=context.num_input_pipelines,
            worker_index=context.input_pipeline_id,
        )

    validation = eval_input(dataset, "validation")
    # Every worker evaluates its share of the validation examples; Keras sums the metrics.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    clock = TrainingClock(spec.target_accuracy)
    # Saves model, optimizer and the epoch reached; a restarted (or retried) run resumes from it.
    # Under multi_worker_mirrored only the chief writes there (the others into scratch dirs).
    backup = tf.keras.callbacks.BackupAndRestore(
        str(paths.checkpoints / "backup"),
        save_freq="epoch" if spec.checkpoint_every == 1 else spec.checkpoint_every * steps,
    )
    started = time.perf_counter()
    history = model.fit(
        strategy.distribute_datasets_from_function(worker_batches),
        epochs=spec.epochs,
        steps_per_epoch=steps,
        validation_data=validation.with_options(options),
        callbacks=[clock, backup],  # clock first: checkpoints are timed between epochs
        verbose=2,  # one line per epoch: readable in the Airflow task log
    )
    train_seconds = time.perf_counter() - started

    save_model(model, spec, dataset, paths.model, chief=is_chief(task))
    if not is_chief(task):
        return
    workers = spec.workers if spec.strategy == "multi_worker_mirrored" else 1
    total_steps = clock.epochs_done * steps
    epochs_seconds = sum(clock.epoch_seconds)
    write_training_record(
        paths,
        training_record(
            spec,
            steps=steps,
            replicas_in_sync=replicas,
            history={name: [float(v) for v in values] for name, values in history.history.items()},
            lr_per_epoch=lr_per_epoch,
            clock=clock,
            train_seconds=train_seconds,
            measured_seconds=epochs_seconds,
            # Sync steps are lockstep: every worker does every step in the same wall time.
            per_worker={
                f"worker-{i}": worker_rate(spec.batch_size // workers, total_steps, epochs_seconds)
                for i in range(workers)
            },
        ),
    )

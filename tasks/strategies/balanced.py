"""Balanced synchronous training: multi_worker_mirrored with per-worker batches proportional to
each worker's measured speed (``balance_batches``, chosen by ``strategy=auto`` for uneven workers).

With equal batches every step waits for the slowest worker. Here worker i takes a share b_i of
each global batch B (b_i proportional to its probed examples/s, sum b_i = B), so all finish a step
at about the same time. Every worker shuffles the examples in the same order (same seed) and
batches only those at its own positions of each global batch (``train_slices``), so the slices of
a step are exactly the global batch. Each worker's loss is its examples' summed loss divided by B,
not by b_i; all-reduce sums the gradients, so the update is exactly the mean gradient over the
global batch, as one replica with batch B would compute it.

Validation is balanced the same way: each worker scores its share of the validation split and the
sums are all-reduced, so every worker sees the same accuracy (and stops at the target together)
without the slow worker scoring the whole split.

The shares come from the probe. ``strategy=auto`` probed the workers before launching them (its
choice decides the cluster's layout) and wrote them to plan.json; with ``balance_batches=true``
every worker probes itself here, right after the strategy connects the workers and before
training, and the speeds are exchanged in one collective: one launch instead of two.

A custom loop serves this: ``model.fit`` divides each replica's loss by its own batch size and
would weight a small share as much as a large one.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import tensorflow as tf

from tasks.auto import split_batch
from tasks.data.pipeline import eval_input, train_slices
from tasks.models import build_model
from tasks.paths import RunPaths, write_record
from tasks.spec import RunSpec
from tasks.strategies.common import (
    EpochCheckpoint,
    TrainingClock,
    learning_rate,
    make_optimizer,
    run_epochs,
    save_model,
    steps_per_epoch,
    training_record,
    validation_sums,
    worker_rate,
    write_training_record,
)
from tasks.strategies.probe import measure
from tasks.strategies.sync import is_chief, make_strategy


def worker_shares(spec: RunSpec, dataset: dict[str, Any], paths: RunPaths, task: dict[str, Any], sum_over_workers):
    """Every worker's batch share: equal when ``batch_shares=equal`` (no probe); from plan.json when
    the workers were probed already (by ``strategy=auto``, or before a restart of this group);
    otherwise probed here, all workers at once, the chief recording the probes and shares in
    plan.json."""
    if spec.batch_shares == "equal":
        return split_batch(spec.batch_size, [1.0] * spec.workers)
    plan = json.loads(paths.plan.read_text()) if paths.plan.exists() else {}
    if "worker_batches" in plan:
        return plan["worker_batches"]
    mine = measure(spec, dataset, paths, task, barrier=lambda: sum_over_workers([0.0]))
    slots = [0.0] * (2 * spec.workers)  # (examples/s, step seconds) per worker, zeros but this worker's
    slots[2 * task["index"] : 2 * task["index"] + 2] = mine["examples_per_second"], mine["step_seconds"]
    measured = sum_over_workers(slots)
    probes = [
        {
            "worker": f"worker-{i}",
            "batch": mine["batch"],
            "examples_per_second": measured[2 * i],
            "step_seconds": measured[2 * i + 1],
            "model_parameters": mine["model_parameters"],
        }
        for i in range(spec.workers)
    ]
    shares = split_batch(spec.batch_size, [probe["examples_per_second"] for probe in probes])
    if is_chief(task):
        plan = {"requested": spec.model_dump(), "probes": probes, "worker_batches": shares}
        write_record(paths.plan, plan)
    return shares


def train(spec: RunSpec, dataset: dict[str, Any], paths: RunPaths, task: dict[str, Any]) -> None:
    strategy = make_strategy(spec)

    @tf.function
    def sum_values_over_workers(values):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: values), axis=None)

    def sum_over_workers(values: list[float]) -> list[float]:
        return sum_values_over_workers(tf.constant(values, tf.float64)).numpy().tolist()

    shares = worker_shares(spec, dataset, paths, task, sum_over_workers)
    offsets = [0, *itertools.accumulate(shares)]
    steps = steps_per_epoch(spec, dataset)
    schedule, lr_per_epoch = learning_rate(spec, steps)
    with strategy.scope():
        model = build_model(spec.model, dataset["input_shape"], dataset["num_classes"], spec.seed)
        optimizer = make_optimizer(spec, schedule)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def worker_slice(context: tf.distribute.InputContext) -> tf.data.Dataset:
        start, end = offsets[context.input_pipeline_id], offsets[context.input_pipeline_id + 1]
        return train_slices(
            dataset, start=start, end=end, global_batch=spec.batch_size, shuffle=spec.shuffle, seed=spec.seed
        )

    batches = iter(strategy.distribute_datasets_from_function(worker_slice))

    def replica_step(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = tf.reduce_sum(loss_fn(labels, logits)) / spec.batch_size
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))  # all-reduce: sum over workers
        correct = tf.reduce_sum(tf.cast(tf.argmax(logits, axis=1) == labels, tf.float32))
        return loss, correct

    @tf.function
    def train_step(iterator):
        # This worker's part only: summing loss and accuracy over workers every step would add two
        # collectives per step, each waiting on the slowest worker; run_epochs sums once per epoch.
        loss, correct = strategy.run(replica_step, args=next(iterator))
        return strategy.experimental_local_results(loss)[0], strategy.experimental_local_results(correct)[0]

    predict = tf.function(lambda images: model(images, training=False))
    validation_size = dataset["splits"]["validation"]
    first, last = (round(offsets[i] * validation_size / spec.batch_size) for i in (task["index"], task["index"] + 1))
    my_validation = eval_input(dataset, "validation", examples=(first, last))

    with strategy.scope():
        checkpoint = EpochCheckpoint(spec, paths, is_chief(task), model, optimizer)
    clock = TrainingClock(spec.target_accuracy)
    print(f"balanced batches {shares} of {spec.batch_size}; this worker takes {shares[task['index']]}", flush=True)
    started = time.perf_counter()
    history = run_epochs(
        spec,
        steps,
        lambda: train_step(batches),
        lambda: validation_sums(predict, my_validation),
        checkpoint,
        clock,
        sum_over_workers,
    )
    train_seconds = time.perf_counter() - started

    save_model(model, spec, dataset, paths.model, chief=is_chief(task))
    if not is_chief(task):
        return
    total_steps = clock.epochs_done * steps
    write_training_record(
        paths,
        training_record(
            spec,
            steps=steps,
            replicas_in_sync=strategy.num_replicas_in_sync,
            history=history,
            lr_per_epoch=lr_per_epoch,
            clock=clock,
            train_seconds=train_seconds,
            per_worker={
                f"worker-{i}": {**worker_rate(share, total_steps, train_seconds), "batch": share}
                for i, share in enumerate(shares)
            },
            per_replica_batch=shares,
            balanced=True,
            worker_batches=shares,
        ),
    )

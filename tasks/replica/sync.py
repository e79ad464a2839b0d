"""Synchronous data-parallel training, one loop for one_device, mirrored and multi_worker_mirrored,
with equal shares of each global batch or (``balance_batches``) shares proportional to each
worker's measured speed.

With equal batches every step waits for the slowest worker. Balanced, worker i takes a share b_i
of each global batch B (b_i proportional to its probed examples/s, sum b_i = B), so all finish a
step at about the same time. Every worker shuffles the examples in the same order (same seed) and
batches only those at its own positions of each global batch (``train_slices``), so the slices of
a step are exactly the global batch. Each replica's loss is its examples' summed loss divided by
B, not by b_i; all-reduce sums the gradients, so the update is exactly the mean gradient over the
global batch, as one replica with batch B would compute it. A worker with several devices
(mirrored, or multi_worker_mirrored with devices_per_worker > 1) splits its share evenly over them.

Validation is shared the same way: each worker scores its share of the validation examples and
the sums are all-reduced once per epoch, so every worker sees the same accuracy (and stops at the
target together) without the slow worker scoring the whole split.

The shares come from a probe. ``strategy=auto`` probed the workers before launching them (its
choice decides the cluster's layout) and wrote them to plan.json; with ``balance_batches=true``
alone the workers measure themselves during their first training steps (``tasks.replica.balance``)
and rebalance there: no launch and no steps spent on measuring only.

A custom loop, not ``model.fit``: fit divides each replica's loss by its own batch size (it would
weight a small share as much as a large one), all-reduces its metrics every step (two collectives
per step waiting on the slowest worker), and under multi_worker_mirrored spent 45 s after its last
epoch before returning (bench/RESULTS.md, 2026-11-23: 300-step epochs); this loop's shutdown takes
under a second.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
from typing import Any

import tensorflow as tf

from tasks.auto_strategy import decide
from tasks.batch_shares import split_batch
from tasks.data.pipeline import eval_input, train_slices
from tasks.models import build_model
from tasks.paths import RunPaths, write_record
from tasks.replica.balance import ROUNDS, MeasuringRound, Relaunch
from tasks.replica.checkpoint import EpochCheckpoint
from tasks.replica.loop import EpochLoop, validation_sums
from tasks.replica.record import Trained, worker_rate
from tasks.replica.runtime import local_devices
from tasks.schedule import make_optimizer, steps_per_epoch
from tasks.spec import RunSpec, parse_spec


def make_strategy(spec: RunSpec) -> tf.distribute.Strategy:
    if spec.strategy == "one_device":
        # The default strategy: TensorFlow places the ops on the one device this replica sees.
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


def planned_shares(spec: RunSpec, paths: RunPaths, workers: int) -> list[int] | None:
    """Every worker's share of the global batch: equal without ``balance_batches``; from plan.json
    where the workers were probed already (by ``strategy=auto``, or before a restart of this group);
    None where they are to be measured in training."""
    if not spec.balance_batches:
        return split_batch(spec.batch_size, [1.0] * workers)
    plan = json.loads(paths.plan.read_text()) if paths.plan.exists() else {}
    return plan.get("worker_batches")


def train(spec: RunSpec, dataset: dict[str, Any], paths: RunPaths, task: dict[str, Any]) -> Trained:
    strategy = make_strategy(spec)
    workers = spec.workers if spec.strategy == "multi_worker_mirrored" else 1
    local_replicas = strategy.num_replicas_in_sync // workers

    @tf.function
    def sum_values_over_workers(values):
        def once_per_worker():
            # Every replica holds its worker's values: only each worker's first one counts them.
            first_on_worker = tf.distribute.get_replica_context().replica_id_in_sync_group % local_replicas == 0
            return values * tf.cast(first_on_worker, values.dtype)

        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(once_per_worker), axis=None)

    def sum_over_workers(values: list[float]) -> list[float]:
        return sum_values_over_workers(tf.constant(values, tf.float64)).numpy().tolist()

    planned = planned_shares(spec, paths, workers)
    equal = split_batch(spec.batch_size, [1.0] * workers)
    shares = planned or equal
    loop = EpochLoop(spec, steps_per_epoch(spec, dataset))
    with strategy.scope():
        model = build_model(spec.model, dataset["input_shape"], dataset["num_classes"], spec.seed)
        optimizer = make_optimizer(spec, loop.schedule)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def worker_slices(worker: int, shares: list[int]) -> tf.data.Dataset:
        # The worker's replicas take its dataset's batches in turn, so it yields their slices in turn.
        replica_shares = [part for share in shares for part in split_batch(share, [1.0] * local_replicas)]
        offsets = [0, *itertools.accumulate(replica_shares)]
        slices = [
            train_slices(
                dataset,
                start=offsets[r],
                end=offsets[r + 1],
                global_batch=spec.batch_size,
                shuffle=spec.shuffle,
                seed=spec.seed,
            )
            for r in range(worker * local_replicas, (worker + 1) * local_replicas)
        ]
        parts = tf.data.Dataset.zip(tuple(slices))
        return parts.flat_map(
            lambda *batches: functools.reduce(
                tf.data.Dataset.concatenate, [tf.data.Dataset.from_tensors(batch) for batch in batches]
            )
        )

    if local_replicas == 1:
        # A worker with one replica feeds it its own batches: strategy.run hands a plain tensor to the
        # worker's one replica. A distributed iterator costs ~0.1 s per step under multi_worker_mirrored
        # for nothing here (measured 2026-11-24, one worker, convnet steps of 64 examples: 0.30 s
        # through it, 0.19 s fed directly; the default strategy showed no such cost).
        batches = iter(worker_slices(task["index"], shares))
    else:
        batches = iter(
            strategy.distribute_datasets_from_function(lambda context: worker_slices(context.input_pipeline_id, shares))
        )

    def replica_gradients(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = tf.reduce_sum(loss_fn(labels, logits)) / spec.batch_size
        correct = tf.reduce_sum(tf.cast(tf.argmax(logits, axis=1) == labels, tf.float32))
        return tape.gradient(loss, model.trainable_variables), loss, correct

    def replica_apply(gradients):
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))  # all-reduce: sum over replicas

    def replica_step(images, labels):
        gradients, loss, correct = replica_gradients(images, labels)
        replica_apply(gradients)
        return loss, correct

    @tf.function
    def train_step(iterator):
        # This worker's part only: summing loss and accuracy over workers every step would add two
        # collectives per step, each waiting on the slowest worker; the epoch loop sums once per epoch.
        loss, correct = strategy.run(replica_step, args=next(iterator))
        return tuple(tf.add_n(strategy.experimental_local_results(value)) for value in (loss, correct))

    # While measuring (balance_batches, one replica per worker): the gradients and their all-reduce
    # in two calls, to time this worker's computation apart from its wait for the slowest one.
    compute_gradients = tf.function(lambda images, labels: strategy.run(replica_gradients, args=(images, labels)))
    apply_gradients = tf.function(lambda gradients: strategy.run(replica_apply, args=(gradients,)))
    measuring = None
    if planned is None:
        measuring = MeasuringRound(1, task["index"], workers, model.count_params(), sum_over_workers)
    steps_taken = 0  # global batches taken from the stream, which a change of shares goes on from
    examples_taken = [0] * workers  # by each worker: its shares change while measuring
    first_round: list[dict[str, Any]] = []

    def step():
        nonlocal batches, shares, measuring, steps_taken, first_round
        steps_taken += 1
        examples_taken[:] = [taken + share for taken, share in zip(examples_taken, shares)]
        if measuring is None:
            return train_step(batches)
        images, labels = next(batches)
        started = time.perf_counter()
        gradients, loss, correct = compute_gradients(images, labels)
        computed = time.perf_counter() - started
        apply_gradients(gradients)
        probes = measuring.timed(shares[task["index"]], computed)
        if probes:
            mine = probes[task["index"]]
            print(
                f"probe worker-{task['index']}: {mine['examples_per_second']:.0f} examples/s "
                f"({1000 * mine['step_seconds']:.1f} ms of computation per step of {mine['batch']}, "
                f"{mine['measured']})",
                flush=True,
            )
            if measuring.number < ROUNDS:
                first_round = probes
                shares = split_batch(spec.batch_size, [p["examples_per_second"] for p in probes])
                measuring = MeasuringRound(
                    measuring.number + 1, task["index"], workers, model.count_params(), sum_over_workers
                )
                print(f"measuring again on batches {shares} of {spec.batch_size}", flush=True)
            else:
                shares = shares_measured(first_round, probes)
                announce_shares()
                measuring = None
            batches = iter(worker_slices(task["index"], shares).skip(steps_taken))
        return loss, correct

    requested = json.loads(paths.requested_spec.read_text()) if paths.requested_spec.exists() else None  # auto
    balanced = spec.balance_batches

    def shares_measured(first_round: list[dict[str, Any]], probes: list[dict[str, Any]]) -> list[int]:
        """The shares to go on with: balanced, or what strategy=auto decides from the probes."""
        nonlocal balanced
        plan = {"requested": requested or spec.model_dump(mode="json"), "first_round": first_round, "probes": probes}
        if requested is not None:
            plan["decision"] = decide(parse_spec(requested), probes)
            print(plan["decision"]["reason"], flush=True)
            if plan["decision"]["strategy"] != "multi_worker_mirrored":
                if is_chief(task):
                    write_record(paths.plan, plan)
                raise Relaunch(plan["decision"]["reason"])
            balanced = plan["decision"]["settings"]["balance_batches"]
        speeds = [p["examples_per_second"] for p in probes] if balanced else [1.0] * workers
        plan["worker_batches"] = split_batch(spec.batch_size, speeds)
        if is_chief(task):
            write_record(paths.plan, plan)
        return plan["worker_batches"]

    def announce_shares():
        kind = "balanced" if balanced else "equal"
        print(f"{kind} batches {shares} of {spec.batch_size}; this worker takes {shares[task['index']]}", flush=True)

    predict = tf.function(lambda images: model(images, training=False))
    validation_inputs: dict[tuple[int, ...], tf.data.Dataset] = {}

    def score_my_validation():
        # This worker's share of the validation split, in proportion to its share of the batch.
        if tuple(shares) not in validation_inputs:
            validation_size = dataset["splits"]["validation"]
            worker_offsets = [0, *itertools.accumulate(shares)]
            first, last = (
                round(worker_offsets[i] * validation_size / spec.batch_size) for i in (task["index"], task["index"] + 1)
            )
            validation_inputs[tuple(shares)] = eval_input(dataset, "validation", examples=(first, last))
        return validation_sums(predict, validation_inputs[tuple(shares)])

    with strategy.scope():
        checkpoint = EpochCheckpoint(spec, paths, is_chief(task), model, optimizer)
    if measuring is None:
        announce_shares()
    else:
        print(f"equal batches {shares} of {spec.batch_size} while measuring each worker's speed", flush=True)
    loop.run(
        loop.one_step_at_a_time(step),
        score_my_validation,
        checkpoint,
        sum_over_workers if workers > 1 else None,
    )
    total_steps = loop.clock.epochs_done * loop.steps
    per_worker = {}
    for i, share in enumerate(shares):
        mean_batch = examples_taken[i] / steps_taken if steps_taken else share
        per_worker[f"worker-{i}"] = {**worker_rate(mean_batch, total_steps, loop.train_seconds), "batch": share}
    fields = {
        "replicas_in_sync": strategy.num_replicas_in_sync,
        "per_worker": per_worker,
        # Without balance_batches the shares are equal (validation requires it).
        "per_replica_batch": shares if balanced else split_batch(shares[0], [1.0] * local_replicas)[0],
        "balanced": balanced,
        "worker_batches": shares,
    }
    return Trained(loop, model, fields, chief=is_chief(task))

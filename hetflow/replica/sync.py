"""Synchronous data-parallel training, one loop for one_device, mirrored and multi_worker_mirrored,
with equal shares of each global batch or (``balance_batches``) shares proportional to each
worker's measured speed.

With equal batches every step waits for the slowest worker. Balanced, worker i takes a share b_i
of each global batch B (b_i proportional to its measured examples/s, sum b_i = B), so all finish a
step at about the same time. Every worker shuffles the examples in the same order (same seed) and
batches only those at its own positions of each global batch (``train_slices``), so the slices of
a step are exactly the global batch. Each replica's loss is its examples' summed loss divided by
B, not by b_i; all-reduce sums the gradients, so the update is exactly the mean gradient over the
global batch, as one replica with batch B would compute it. A worker with several devices
(mirrored, or multi_worker_mirrored with devices_per_worker > 1) splits its share evenly over them.

Validation is shared the same way: each worker scores its share of the validation examples and
the sums are all-reduced once per epoch, so every worker sees the same accuracy (and stops at the
target together) without the slow worker scoring the whole split.

The shares are ``hetflow.replica.balance``'s: equal without ``balance_batches``; with it measured in
the seconds before the first step; or plan.json's, where an earlier launch of this group measured
them (strategy=auto's launch, which measures its workers here and stops).

A custom loop, not ``model.fit``: fit divides each replica's loss by its own batch size (it would
weight a small share as much as a large one), all-reduces its metrics every step (two collectives
per step waiting on the slowest worker), and under multi_worker_mirrored spent tens of seconds
after its last epoch before returning; this loop's shutdown takes under a second (bench/RESULTS.md's
"shutdown" column).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import tensorflow as tf

from hetflow.data.pipeline import (
    eval_input,
    share_input,
    share_read,
    train_slices,
    training_input,
    training_tensors,
    validation_input,
)
from hetflow.models.architectures import build_model
from hetflow.models.schedule import make_optimizer, steps_per_epoch
from hetflow.paths import RunPaths
from hetflow.records import DatasetRecord
from hetflow.replica.balance import WorkerShares
from hetflow.replica.batch_shares import split_batch
from hetflow.replica.checkpoint import EpochCheckpoint
from hetflow.replica.collectives import COMMUNICATION, collectives_record, reduce_gradients, time_reduction
from hetflow.replica.loop import EpochLoop, validation_sums
from hetflow.replica.record import Trained, worker_rate
from hetflow.replica.runtime import local_devices
from hetflow.spec import RunSpec


def make_strategy(spec: RunSpec) -> tf.distribute.Strategy:
    if spec.cluster.strategy == "one_device":
        # The default strategy: TensorFlow places the ops on the one device this replica sees.
        return tf.distribute.get_strategy()
    if spec.cluster.strategy == "mirrored":
        return tf.distribute.MirroredStrategy(local_devices(spec.cluster.worker_device(0).count))
    # multi_worker_mirrored, and strategy=auto's launch that measures the workers
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=COMMUNICATION)


def is_chief(task: dict[str, Any]) -> bool:
    return task["type"] == "worker" and task["index"] == 0


def train(spec: RunSpec, dataset: DatasetRecord, paths: RunPaths, task: dict[str, Any]) -> Trained:
    return SyncWorker(spec, dataset, paths, task).train()


class SyncWorker:
    """One worker of a synchronous run: its strategy, model and share of every global batch."""

    def __init__(self, spec: RunSpec, dataset: DatasetRecord, paths: RunPaths, task: dict[str, Any]):
        self.spec, self.dataset, self.paths, self.task = spec, dataset, paths, task
        self.chief = is_chief(task)
        self.strategy = make_strategy(spec)
        self.shares = WorkerShares(spec, paths, task["index"], self.chief)
        self.workers = self.shares.workers
        self.local_replicas = self.strategy.num_replicas_in_sync // self.workers
        self.loop = EpochLoop(spec, steps_per_epoch(spec, dataset), paths.progress if self.chief else None)
        with self.strategy.scope():
            self.model = build_model(
                spec.model.architecture, dataset.input_shape, dataset.num_classes, spec.training.seed
            )
            self.optimizer = make_optimizer(spec, self.loop.schedule)
        self.loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        self.reads = training_input(dataset, spec.training.shuffle_buffer, spec.training.cache_budget_mb)
        # A split that fits the cache budget is loaded once, whole: measuring and training slice it.
        self.training_examples = training_tensors(dataset) if self.reads["mode"] == "cached" else None
        self.validation_read: dict[str, Any] | None = None  # my_validation's, for the record

    @tf.function
    def _sum_values_over_workers(self, values):
        def once_per_worker():
            # Every replica holds its worker's values: only each worker's first one counts them.
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            return values * tf.cast(replica % self.local_replicas == 0, values.dtype)

        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, self.strategy.run(once_per_worker), axis=None)

    def sum_over_workers(self, values: list[float]) -> list[float]:
        return self._sum_values_over_workers(tf.constant(values, tf.float64)).numpy().tolist()

    def replica_offsets(self, worker_shares: list[int]) -> list[int]:
        """Where each replica's part of a global batch starts (and, last, the batch's end)."""
        parts = [part for share in worker_shares for part in split_batch(share, [1.0] * self.local_replicas)]
        return [0, *itertools.accumulate(parts)]

    def share_batches(self, start: int, end: int) -> tf.data.Dataset:
        """The examples ``start:end`` of every global batch: gathered from the cached split in the order
        one worker with the global batch would see them (``train_slices``), or, for a split over the
        cache budget, drawn from the share's own files only (``share_input``)."""
        training = self.spec.training
        options = {
            "start": start,
            "end": end,
            "global_batch": training.batch_size,
            "shuffle": training.shuffle,
            "seed": training.seed,
            "shuffle_buffer": training.shuffle_buffer,
        }
        if self.training_examples is None:
            return share_input(self.dataset, **options)
        return train_slices(self.training_examples, **options)

    def worker_slices(self, worker: int, worker_shares: list[int]) -> tf.data.Dataset:
        """The worker's part of every global batch; its replicas take its batches in turn, so it
        yields their slices in turn."""
        offsets = self.replica_offsets(worker_shares)
        replicas = range(worker * self.local_replicas, (worker + 1) * self.local_replicas)
        slices = [self.share_batches(offsets[r], offsets[r + 1]) for r in replicas]
        parts = tf.data.Dataset.zip(tuple(slices))
        return parts.flat_map(
            lambda *batches: functools.reduce(
                tf.data.Dataset.concatenate, [tf.data.Dataset.from_tensors(batch) for batch in batches]
            )
        )

    def replica_gradients(self, images, labels):
        model = self.model
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = tf.reduce_sum(self.loss_fn(labels, logits)) / self.spec.training.batch_size
        correct = tf.reduce_sum(tf.cast(tf.argmax(logits, axis=1) == labels, tf.float32))
        return tape.gradient(loss, model.trainable_variables), loss, correct

    def replica_step(self, images, labels):
        gradients, loss, correct = self.replica_gradients(images, labels)
        # Summed over the replicas here, not inside the optimizer: the same all-reduce is timed alone.
        self.optimizer.apply_gradients(
            zip(reduce_gradients(gradients), self.model.trainable_variables), skip_gradients_aggregation=True
        )
        return loss, correct

    @tf.function
    def train_step(self, iterator):
        # This worker's part only: summing loss and accuracy over workers every step would add two
        # collectives per step, each waiting on the slowest worker; the epoch loop sums once per epoch.
        strategy = self.strategy
        loss, correct = strategy.run(self.replica_step, args=next(iterator))
        return tuple(tf.add_n(strategy.experimental_local_results(value)) for value in (loss, correct))

    def measure_shares(self) -> None:
        """balance_batches (one replica per worker): each worker's speed on its gradients, none applied."""
        strategy = self.strategy
        compute_gradients = tf.function(
            lambda images, labels: strategy.run(self.replica_gradients, args=(images, labels))
        )
        measuring_batches = iter(self.worker_slices(self.task["index"], self.shares.now))
        self.shares.measure(compute_gradients, measuring_batches, self.model.count_params(), self.sum_over_workers)

    def batches(self):
        if self.local_replicas == 1:
            # A worker with one replica feeds it its own batches: strategy.run hands a plain tensor to the
            # worker's one replica. A distributed iterator costs time on every step under
            # multi_worker_mirrored, for nothing here (the default strategy has no such cost).
            return iter(self.worker_slices(self.task["index"], self.shares.now))
        return iter(
            self.strategy.distribute_datasets_from_function(
                lambda context: self.worker_slices(context.input_pipeline_id, self.shares.now)
            )
        )

    def validation_range(self, worker: int) -> tuple[int, int]:
        """Worker ``worker``'s share of the validation split, in proportion to its share of the batch."""
        validation_size = self.dataset.splits["validation"]
        worker_offsets = [0, *itertools.accumulate(self.shares.now)]
        first, last = (
            round(worker_offsets[i] * validation_size / self.spec.training.batch_size) for i in (worker, worker + 1)
        )
        return first, last

    def my_validation(self) -> tf.data.Dataset:
        """This worker's share of the validation split; how the largest share is read goes in the record."""
        budget = self.spec.training.cache_budget_mb
        largest = max(last - first for first, last in map(self.validation_range, range(len(self.shares.now))))
        self.validation_read = validation_input(self.dataset, largest, budget)
        first, last = self.validation_range(self.task["index"])
        return eval_input(self.dataset, "validation", examples=(first, last), cache_budget_mb=budget)

    def each_workers_speed(self, epoch_seconds: float) -> dict:
        # In step with the others: each worker's share of every step, over the epoch's time.
        rates = {f"worker-{i}": share * self.loop.steps / epoch_seconds for i, share in enumerate(self.shares.now)}
        return {"worker_examples_per_second": rates}

    def train(self) -> Trained:
        if self.shares.to_measure:
            self.measure_shares()
        batches = self.batches()
        predict = tf.function(lambda images: self.model(images, training=False))
        my_validation = self.my_validation()
        with self.strategy.scope():
            checkpoint = EpochCheckpoint(self.spec, self.paths, self.chief, self.model, self.optimizer)
        self.shares.announce()
        several = self.workers > 1
        reduction_seconds = (
            time_reduction(self.strategy, self.model.trainable_variables, lambda: self.sum_over_workers([0.0]))
            if several
            else None
        )
        self.loop.run(
            self.loop.one_step_at_a_time(lambda: self.train_step(batches)),
            lambda: validation_sums(predict, my_validation),
            checkpoint,
            self.sum_over_workers if several else None,
            self.each_workers_speed,
        )
        fields = self.record()
        if several:
            fields["collectives"] = collectives_record(
                self.train_step.get_concrete_function(batches), reduction_seconds
            )
        return Trained(self.loop, self.model, fields, chief=self.chief)

    def read(self, worker: int) -> dict[str, Any]:
        """What the worker reads of the training split's files per pass (``share_read``): all of them
        where the split is cached, else only its replicas' ranges; as per_worker's read_ fields."""
        batch = self.spec.training.batch_size
        if self.training_examples is not None:
            return share_read(self.dataset, 0, batch, batch)
        offsets = self.replica_offsets(self.shares.now)
        reads = [
            share_read(self.dataset, offsets[r], offsets[r + 1], batch)
            for r in range(worker * self.local_replicas, (worker + 1) * self.local_replicas)
        ]
        return {
            "read_examples": sum(read["read_examples"] for read in reads),
            "read_files": sorted({name for read in reads for name in read["read_files"]}),
            "read_file_bytes": sum(read["read_file_bytes"] for read in reads),
        }

    def record(self) -> dict[str, Any]:
        """What training.json says of this run's workers and their shares."""
        shares, loop = self.shares, self.loop
        total_steps = loop.clock.epochs_done * loop.steps
        per_worker = {
            f"worker-{i}": {**worker_rate(share, total_steps, loop.train_seconds), "batch": share, **self.read(i)}
            for i, share in enumerate(shares.now)
        }
        return {
            "replicas_in_sync": self.strategy.num_replicas_in_sync,
            "per_worker": per_worker,
            # Without balance_batches the shares are equal (validation requires it).
            "per_replica_batch": shares.now
            if shares.balanced
            else split_batch(shares.now[0], [1.0] * self.local_replicas)[0],
            "balanced": shares.balanced,
            # cached: every worker holds the whole split as tensors and gathers its share from them
            "training_input": {
                **self.reads,
                "mode": "whole_split_tensors" if self.training_examples is not None else "own_files",
            },
            "worker_batches": shares.now,
            "validation_input": self.validation_read,  # each worker validates on its share
        }

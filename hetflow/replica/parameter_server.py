"""Asynchronous parameter-server training: ``ParameterServerStrategy`` + ``ClusterCoordinator``.

The chief coordinates: it schedules training steps, and whichever worker is free runs the next
one, reading the current variables from the ps and applying its gradients there without waiting
for the others. Large variables are sharded over the ps by a size-based partitioner.

A custom loop serves this mode best: it can measure each update's staleness (how many other
updates landed between reading the parameters and applying the gradient) and which worker ran
it, which ``model.fit`` hides. ``STEPS_PER_CLOSURE`` steps run per scheduled function, since each
schedule costs a round trip (the same idea as ``steps_per_execution``).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import numpy as np
import tensorflow as tf

from hetflow.data.pipeline import eval_input, fits_cache, range_input, range_read, share_examples, training_input
from hetflow.models.architectures import build_model
from hetflow.models.schedule import make_optimizer, steps_per_epoch
from hetflow.paths import RunPaths
from hetflow.records import DatasetRecord
from hetflow.replica.checkpoint import EpochCheckpoint
from hetflow.replica.loop import EpochLoop, validation_sums
from hetflow.replica.ps_exchange import communication_record, time_exchange
from hetflow.replica.record import Trained, worker_rate
from hetflow.spec import RunSpec

STEPS_PER_CLOSURE = 10
# Variables above this size are split over the ps (at most one shard per ps).
MIN_SHARD_BYTES = 16 << 10


def _per_worker_ids(coordinator):
    """Each worker's index, held on that worker: the coordinator hands a scheduled function the
    value of the worker that runs it, which is how a step reports where it ran. (TensorFlow has
    no public call to create a different value per worker, hence ``_cluster``.)"""
    hold = tf.function(tf.identity)
    ids = tuple(
        worker.create_resource(hold, args=(tf.constant(index, tf.int64),))
        for index, worker in enumerate(coordinator._cluster.workers)
    )
    return tf.distribute.experimental.coordinator.PerWorkerValues(ids)


def _per_worker_iterators(coordinator, worker_dataset):
    """An iterator on each worker over ``worker_dataset(its index)``, for ``schedule``.

    ``create_per_worker_dataset`` traces one dataset function for every worker, which none can
    tell itself apart in, so every worker would read the whole split; this does what it does (a
    traced function run on the worker, whose iterator is a resource the coordinator rebuilds if
    the worker restarts), one function per worker."""
    iterators = []
    for index, worker in enumerate(coordinator._cluster.workers):
        make_dataset = tf.function(functools.partial(worker_dataset, index)).get_concrete_function()
        remote = worker.create_resource(lambda make_dataset=make_dataset: iter(make_dataset()))
        # What schedule traces its function with (create_per_worker_dataset sets it the same way).
        remote._type_spec = tf.data.IteratorSpec(make_dataset.structured_outputs.element_spec)
        iterators.append(remote)
    return tf.distribute.experimental.coordinator.PerWorkerValues(tuple(iterators))


def train(spec: RunSpec, dataset: DatasetRecord, paths: RunPaths, task: dict[str, Any]) -> Trained:
    """The chief's part: the other replicas ``serve``."""
    return AsyncChief(spec, dataset, paths).train()


class AsyncChief:
    """The chief of an asynchronous run: it schedules closures of steps on whichever worker is free
    and keeps the staleness of every update and the worker that applied it."""

    def __init__(self, spec: RunSpec, dataset: DatasetRecord, paths: RunPaths):
        self.spec, self.dataset, self.paths = spec, dataset, paths
        self.strategy = tf.distribute.ParameterServerStrategy(
            tf.distribute.cluster_resolver.TFConfigClusterResolver(),
            variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
                min_shard_bytes=MIN_SHARD_BYTES, max_shards=spec.cluster.ps.replicas
            ),
        )
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        # ceil: at least the steps asked for
        self.closures_per_epoch = -(-steps_per_epoch(spec, dataset) // STEPS_PER_CLOSURE)
        # Async: every update is one worker's batch_size examples, the batch the scaling rule sees.
        self.loop = EpochLoop(spec, self.closures_per_epoch * STEPS_PER_CLOSURE, paths.progress)
        with self.strategy.scope():
            self.model = build_model(
                spec.model.architecture, dataset.input_shape, dataset.num_classes, spec.training.seed
            )
            self.optimizer = make_optimizer(spec, self.loop.schedule)
            # Counts applied updates; lives on a ps, so every worker sees the others' increments.
            self.updates_applied = tf.Variable(0, dtype=tf.int64, trainable=False, name="updates_applied")
        self.loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        self.run_closure = tf.function(self._closure)
        self.all_staleness: list[int] = []
        self.staleness_by_worker: dict[int, list[int]] = {}
        self.steps_this_epoch: dict[int, int] = {}

    def worker_part(self, worker: int) -> tuple[int, int]:
        """The training examples (first, last) worker ``worker`` reads: the split cut in equal parts,
        one per worker, so each opens only the TFRecord files of its own part."""
        return share_examples(self.dataset, worker, worker + 1, self.spec.cluster.worker.replicas)

    def part_cached(self) -> bool:
        """Whether every worker's part fits cache_budget_mb (the largest part decides)."""
        first, last = self.worker_part(self.spec.cluster.worker.replicas - 1)
        return fits_cache(self.dataset, last - first, self.spec.training.cache_budget_mb)

    def worker_batches(self, worker: int) -> tf.data.Dataset:
        # Async training is not reproducible anyway (which worker runs which step is up to
        # scheduling): the seed only fixes each worker's order over its own part.
        training = self.spec.training
        return range_input(
            self.dataset,
            *self.worker_part(worker),
            batch=training.batch_size,
            shuffle=training.shuffle,
            seed=training.seed + worker,
            shuffle_buffer=training.shuffle_buffer,
            cache=self.part_cached(),
        )

    def one_update(self, images, labels):
        model, updates_applied = self.model, self.updates_applied
        # Staleness = updates applied between reading the parameters and applying this gradient.
        read_at = updates_applied.read_value()
        with tf.control_dependencies([read_at]):  # the parameters are read after the counter
            with tf.GradientTape() as tape:
                logits = model(images, training=True)
                loss = tf.nn.compute_average_loss(self.loss_fn(labels, logits))
            gradients = tape.gradient(loss, model.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        # A tf.function orders ops on the same variable only, so the update of each parameter is
        # waited for by an op on that parameter (run on its ps, nothing is fetched); only then
        # is the counter increased. ResourceCountUpTo increments and returns the count before,
        # atomically (a plain assign_add then read could include another worker's increment);
        # its limit is never reached.
        updated = [tf.raw_ops.VarIsInitializedOp(resource=v.handle) for v in model.trainable_variables]
        with tf.control_dependencies(updated):
            applied_at = tf.raw_ops.ResourceCountUpTo(resource=updates_applied.handle, limit=2**62, T=tf.int64)
        correct = tf.reduce_sum(tf.cast(tf.argmax(logits, axis=1) == labels, tf.float32))
        return loss, correct, applied_at - read_at

    def _closure(self, iterator, worker_id):
        losses = tf.TensorArray(tf.float32, size=STEPS_PER_CLOSURE)
        staleness = tf.TensorArray(tf.int64, size=STEPS_PER_CLOSURE)
        correct = tf.constant(0.0)
        for i in tf.range(STEPS_PER_CLOSURE):
            images, labels = next(iterator)
            loss, hits, stale = self.strategy.run(self.one_update, args=(images, labels))
            losses = losses.write(i, loss)
            staleness = staleness.write(i, stale)
            correct += hits
        return losses.stack(), correct, staleness.stack(), tf.identity(worker_id)

    def train_epoch(self, iterator, worker_ids) -> tuple[float, float]:
        coordinator, clock = self.coordinator, self.loop.clock
        results = [
            coordinator.schedule(self.run_closure, args=(iterator, worker_ids)) for _ in range(self.closures_per_epoch)
        ]
        if clock.first_step_seconds is None:
            results[0].fetch()  # the first closure's steps done: not the whole first epoch's
            clock.first_step_done()
        coordinator.join()  # bounds the updates in flight, and so the staleness, to one epoch's
        loss_sum, correct = 0.0, 0.0
        self.steps_this_epoch.clear()
        for result in results:
            losses, hits, staleness, worker = result.fetch()
            worker = int(worker)
            self.steps_this_epoch[worker] = self.steps_this_epoch.get(worker, 0) + len(staleness)
            loss_sum += float(np.sum(losses))
            correct += float(hits)
            self.all_staleness.extend(int(s) for s in staleness)
            self.staleness_by_worker.setdefault(worker, []).extend(int(s) for s in staleness)
        return loss_sum, correct

    def staleness_and_speeds(self, epoch_seconds: float) -> dict:
        this_epoch = self.all_staleness[-self.loop.steps :]
        batch = self.spec.training.batch_size
        rates = {f"worker-{w}": batch * steps / epoch_seconds for w, steps in sorted(self.steps_this_epoch.items())}
        return {
            "staleness_mean": float(np.mean(this_epoch)),
            "staleness_max": int(max(this_epoch)),
            "worker_examples_per_second": rates,
        }

    def time_communication(self) -> dict[str, Any]:
        variables = self.model.trainable_variables
        seconds = time_exchange(
            self.strategy, self.coordinator, self.spec.cluster.worker.replicas, variables, STEPS_PER_CLOSURE
        )
        communication = communication_record(variables, seconds, STEPS_PER_CLOSURE)
        print(
            f"communication per step, timed alone: {1000 * communication['seconds_per_step']:.1f} ms "
            f"({communication['bytes_to_worker'] / 1e6:.2f} MB of variables to a worker, as many back to the ps)",
            flush=True,
        )
        return communication

    def train(self) -> Trained:
        iterator = _per_worker_iterators(self.coordinator, self.worker_batches)
        worker_ids = _per_worker_ids(self.coordinator)
        predict = tf.function(lambda images: self.model(images, training=False))
        validation = eval_input(self.dataset, "validation", cache_budget_mb=self.spec.training.cache_budget_mb)
        with self.strategy.scope():
            checkpoint = EpochCheckpoint(
                self.spec, self.paths, True, self.model, self.optimizer, updates_applied=self.updates_applied
            )
        communication = self.time_communication()
        self.loop.run(
            lambda: self.train_epoch(iterator, worker_ids),
            lambda: validation_sums(predict, validation),
            checkpoint,
            epoch_details=self.staleness_and_speeds,
        )
        fields = {
            "replicas_in_sync": 1,
            "per_worker": self.per_worker(),
            "training_input": {
                **training_input(self.dataset, self.spec.training.shuffle_buffer, self.spec.training.cache_budget_mb),
                "mode": "own_files_cached" if self.part_cached() else "own_files",
            },
            "staleness": self.staleness(),
            "sharded_variables": self.shards(),
            "communication": communication,
        }
        return Trained(self.loop, self.model, fields)

    def shards(self) -> dict[str, list[dict[str, Any]]]:
        # The model lists a sharded variable as its parts, named <variable>/part_<i>.
        shards: dict[str, list[dict[str, Any]]] = {}
        for variable in self.model.weights:
            whole, marker, _ = variable.name.rpartition("/part_")
            if marker:
                shards.setdefault(whole, []).append({"shape": variable.shape.as_list(), "device": variable.device})
        return shards

    def per_worker(self) -> dict[str, dict[str, Any]]:
        """Each worker's share of the steps, the staleness of the updates it applied and what it
        read of the training split's files per pass."""
        return {
            f"worker-{worker}": {
                **worker_rate(self.spec.training.batch_size, len(seen), self.loop.train_seconds),
                **range_read(self.dataset, *self.worker_part(worker)),
                "staleness_mean": float(np.mean(seen)),
                "staleness_max": int(max(seen)),
            }
            for worker, seen in sorted(self.staleness_by_worker.items())
        }

    def staleness(self) -> dict[str, Any] | None:
        """None when this attempt applied no update (a retry after the last epoch's checkpoint)."""
        if not self.all_staleness:
            return None
        return {
            "mean": float(np.mean(self.all_staleness)),
            "max": int(max(self.all_staleness)),
            "histogram": {str(k): v for k, v in sorted(Counter(self.all_staleness).items())},
        }

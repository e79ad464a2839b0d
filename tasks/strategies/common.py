"""What every strategy shares: runtime settings, the learning-rate schedule, the training record."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import tensorflow as tf

from tasks.models import build_model
from tasks.paths import RunPaths, write_record
from tasks.spec import RunSpec, WorkerDevice


def replica_device(spec: RunSpec, task: dict[str, Any]) -> WorkerDevice:
    """This replica's device settings: its worker_devices entry; a chief or ps computes nothing
    and takes one CPU."""
    if task["type"] == "worker":
        return spec.worker_device(task["index"])
    return WorkerDevice()


def configure_runtime(spec: RunSpec, task: dict[str, Any]) -> None:
    """Threads and devices; must run before TensorFlow executes its first op."""
    device = replica_device(spec, task)
    threads = device.threads or spec.replica_threads
    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    gpus = tf.config.list_physical_devices("GPU")
    if device.device == "gpu":
        if len(gpus) < device.count:
            raise RuntimeError(f"this replica asks for {device.count} GPU(s) but sees {len(gpus)}")
        tf.config.set_visible_devices(gpus[: device.count], "GPU")
        return
    tf.config.set_visible_devices([], "GPU")
    if device.count > 1:
        # Split the CPU into logical devices, so mirrored and model-parallel placement run for
        # real (on one machine's cores) with the same code as on several GPUs.
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * device.count)


def local_devices(count: int) -> list[str]:
    """The names of ``count`` local devices: GPUs where there are, else (logical) CPUs."""
    devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
    if len(devices) < count:
        raise RuntimeError(f"devices_per_worker={count} but this replica has {len(devices)} devices")
    return [d.name for d in devices[:count]]


def steps_per_epoch(spec: RunSpec, dataset: dict[str, Any]) -> int:
    return spec.steps_per_epoch or max(1, dataset["splits"]["train"] // spec.batch_size)


class WarmupLinearScaling(tf.keras.optimizers.schedules.LearningRateSchedule):
    """Ramp linearly from ``base`` to ``peak`` over ``warmup_steps``, then hold ``peak``."""

    def __init__(self, base: float, peak: float, warmup_steps: int):
        self.base, self.peak, self.warmup_steps = base, peak, warmup_steps

    def __call__(self, step):
        if not self.warmup_steps:
            return tf.constant(self.peak, tf.float32)
        progress = tf.minimum(tf.cast(step, tf.float32) / self.warmup_steps, 1.0)
        return self.base + (self.peak - self.base) * progress

    def get_config(self):
        return {"base": self.base, "peak": self.peak, "warmup_steps": self.warmup_steps}


def learning_rate_plan(spec: RunSpec, steps: int) -> dict[str, Any]:
    """The rates of the schedule, as recorded in training.json.

    The linear scaling rule (Goyal et al. 2017): a rate tuned for a batch of ``lr_reference_batch``
    examples is multiplied by ``batch_size / lr_reference_batch``, since an update on k times the
    examples averages out the noise of k small ones; the warmup avoids the instability of
    starting there. ``batch_size`` is each update's whole batch, so the number of replicas it is
    split over plays no part.
    """
    linear = spec.lr_scaling == "linear"
    return {
        "scaling": spec.lr_scaling,
        "base": spec.learning_rate,
        "reference_batch": spec.lr_reference_batch if linear else None,
        "global_batch": spec.batch_size,
        "peak": spec.learning_rate * spec.batch_size / spec.lr_reference_batch if linear else spec.learning_rate,
        "warmup_steps": round(spec.warmup_epochs * steps),
    }


def learning_rate(spec: RunSpec, steps: int) -> tuple[WarmupLinearScaling, list[float]]:
    """The schedule, and its value at the start of each epoch (logged as the effective schedule).
    The replica count plays no part (see ``learning_rate_plan``)."""
    plan = learning_rate_plan(spec, steps)
    schedule = WarmupLinearScaling(plan["base"], plan["peak"], plan["warmup_steps"])
    return schedule, [float(schedule(epoch * steps)) for epoch in range(spec.epochs)]


def make_optimizer(spec: RunSpec, schedule) -> tf.keras.optimizers.Optimizer:
    optimizers = {"sgd": tf.keras.optimizers.SGD, "adam": tf.keras.optimizers.Adam}
    return optimizers[spec.optimizer](learning_rate=schedule)


class TrainingClock:
    """Where a replica's time goes, from its launch (``HETFLOW_LAUNCH_TIME``) to its final weights,
    told by ``run_epochs`` (its method names are Keras callbacks').

    Records wall time per epoch (validation included) and within it the validation passes; the
    time to the end of the first step; and, given a target accuracy, the training time until
    validation accuracy first reached it (training stops there: ``reached``). ``whole_job`` splits
    the whole job into parts that add up to it. Checkpoints are saved after ``on_epoch_end``, so
    they fall between epochs."""

    def __init__(self, target_accuracy: float | None = None):
        self.launched_at = float(os.environ.get("HETFLOW_LAUNCH_TIME", time.time()))
        self.target_accuracy = target_accuracy
        self.first_step_seconds: float | None = None
        self.epoch_seconds: list[float] = []
        self.validation_seconds: list[float] = []
        self.seconds_to_target: float | None = None
        self.target_reached_at: float | None = None  # unix time: benchmarks time from their own start
        self._epoch_start = 0.0
        self._validation_start = 0.0
        self._first_epoch_began_at: float | None = None  # unix times, comparable with the launch
        self._first_step_at: float | None = None
        self._last_epoch_ended_at: float | None = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = time.perf_counter()
        if self._first_epoch_began_at is None:
            self._first_epoch_began_at = time.time()

    def first_step_done(self) -> None:
        if self.first_step_seconds is None:
            self._first_step_at = time.time()
            self.first_step_seconds = self._first_step_at - self.launched_at

    def on_test_begin(self, logs=None):
        self._validation_start = time.perf_counter()

    def on_test_end(self, logs=None):
        self.validation_seconds.append(time.perf_counter() - self._validation_start)

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_seconds.append(time.perf_counter() - self._epoch_start)
        self._last_epoch_ended_at = time.time()
        accuracy = (logs or {}).get("val_accuracy")
        if self.target_accuracy is not None and not self.reached and accuracy >= self.target_accuracy:
            self.seconds_to_target = sum(self.epoch_seconds)
            self.target_reached_at = time.time()

    @property
    def reached(self) -> bool:
        return self.seconds_to_target is not None

    @property
    def epochs_done(self) -> int:
        return len(self.epoch_seconds)

    def whole_job(self, examples: int) -> dict[str, Any]:
        """The whole job, from the launch to now (call it right after the final weights are
        written): its seconds, ``examples`` per second over them, and ``whole_job_breakdown``,
        parts that add up to it: start-up (launch to the first epoch: process, imports, cluster,
        model, input), the first step (tracing), the other steps, validation, between epochs
        (checkpoints), shutdown (last epoch to the weights written). The breakdown is None when no
        epoch ran here (a resumed run that had nothing left to do)."""
        weights_written_at = time.time()
        seconds = weights_written_at - self.launched_at
        breakdown = None
        if self._first_epoch_began_at is not None and self._first_step_at is not None:
            in_epochs = sum(self.epoch_seconds)
            first_step = self._first_step_at - self._first_epoch_began_at
            validation = sum(self.validation_seconds)
            breakdown = {
                "start_up": self._first_epoch_began_at - self.launched_at,
                "first_step": first_step,
                "steps": in_epochs - first_step - validation,
                "validation": validation,
                "between_epochs": self._last_epoch_ended_at - self._first_epoch_began_at - in_epochs,
                "shutdown": weights_written_at - self._last_epoch_ended_at,
            }
        return {
            "launched_at": self.launched_at,
            "weights_written_at": weights_written_at,
            "whole_job_seconds": seconds,
            "whole_job_examples_per_second": examples / seconds,
            "whole_job_breakdown": breakdown,
        }

    def record(self) -> dict[str, Any]:
        """The timing part of training.json."""
        return {
            "epochs_done": self.epochs_done,
            "epoch_seconds": self.epoch_seconds,
            "validation_seconds": self.validation_seconds,
            "time_to_first_step_seconds": self.first_step_seconds,
            "target_accuracy": self.target_accuracy,
            "seconds_to_target": self.seconds_to_target,
            "target_reached_at": self.target_reached_at,
        }


class EpochCheckpoint:
    """Model, optimizer and the count of finished epochs, saved every ``checkpoint_every`` epochs
    under the run directory. ``restore``
    returns the epoch to resume from: 0 on a fresh start.

    Every replica restores from the chief's checkpoint, so after a restart all resume from the same
    epoch with the same weights. Every replica must also save (under multi_worker_mirrored saving
    may run collectives), but only the chief's copy is the run's: the others write into a scratch
    dir of their own in the run directory."""

    def __init__(self, spec: RunSpec, paths: RunPaths, chief: bool, model, optimizer, **more):
        self.every = spec.checkpoint_every
        self.epochs_done = tf.Variable(0, dtype=tf.int64, trainable=False, name="epochs_done")
        # Slots exist before restoring, so the optimizer state comes back too.
        optimizer.build(model.trainable_variables)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epochs_done=self.epochs_done, **more)
        self.chief_directory = paths.checkpoints / "loop"
        self.chief_directory.mkdir(parents=True, exist_ok=True)
        directory = self.chief_directory if chief else tempfile.mkdtemp(dir=paths.checkpoints, prefix=".scratch-")
        self.manager = tf.train.CheckpointManager(checkpoint, str(directory), max_to_keep=1)

    def restore(self) -> int:
        latest = tf.train.latest_checkpoint(str(self.chief_directory))
        if latest:
            self.manager.checkpoint.restore(latest)
            print(f"resumed from {latest} after epoch {int(self.epochs_done.numpy())}", flush=True)
        return int(self.epochs_done.numpy())

    def epoch_done(self, epochs_done: int) -> None:
        self.epochs_done.assign(epochs_done)
        if epochs_done % self.every == 0:
            self.manager.save()


def validation_sums(predict, batches: tf.data.Dataset) -> tuple[float, float, float]:
    """Summed loss, correctly classified examples and examples of ``predict`` (images -> logits)
    over ``batches``, for custom loops."""
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    total_loss, correct, count = 0.0, 0, 0
    for images, labels in batches:
        logits = predict(images)
        total_loss += float(loss_fn(labels, logits))
        correct += int(tf.reduce_sum(tf.cast(tf.argmax(logits, axis=1) == labels, tf.int32)))
        count += int(tf.shape(labels)[0])
    return total_loss, float(correct), float(count)


def one_step_at_a_time(train_step, steps: int, clock: TrainingClock):
    """An epoch of ``steps`` calls of ``train_step()``, each returning this replica's part of
    (loss, correctly classified examples): the ``train_epoch`` of ``run_epochs``."""

    def train_epoch() -> tuple[float, float]:
        loss_sum, correct = 0.0, 0.0
        for _ in range(steps):
            loss, hits = train_step()
            clock.first_step_done()
            loss_sum += float(loss)
            correct += float(hits)
        return loss_sum, correct

    return train_epoch


def run_epochs(
    spec: RunSpec,
    steps: int,
    train_epoch,
    score_validation,
    checkpoint: EpochCheckpoint,
    clock: TrainingClock,
    sum_over_workers=None,
    describe_epoch=None,
) -> dict[str, list[float]]:
    """The epoch loop every strategy runs, from the last checkpoint on: ``train_epoch()`` trains
    ``steps`` updates of ``spec.batch_size`` examples (telling ``clock`` when the first is done) and
    returns this replica's part of their summed loss and correctly classified examples; after each
    epoch come ``score_validation()`` (this replica's summed validation loss, correct examples and
    examples), one ``sum_over_workers`` of all of it (None for one process: a single collective per
    epoch, none per step), a progress line (with ``describe_epoch()`` appended, if given), the
    checkpoint, and a stop once the target is reached (every replica sees the same validation
    accuracy, so all stop together)."""
    history: dict[str, list[float]] = {"loss": [], "accuracy": [], "val_loss": [], "val_accuracy": []}
    for epoch in range(checkpoint.restore(), spec.epochs):
        clock.on_epoch_begin(epoch)
        loss_sum, correct = train_epoch()
        clock.on_test_begin()
        sums = [loss_sum, correct, *score_validation()]
        loss_sum, correct, val_loss_sum, val_correct, val_count = sum_over_workers(sums) if sum_over_workers else sums
        clock.on_test_end()
        val_accuracy = val_correct / val_count
        clock.on_epoch_end(epoch, {"val_accuracy": val_accuracy})
        values = (loss_sum / steps, correct / (steps * spec.batch_size), val_loss_sum / val_count, val_accuracy)
        for name, value in zip(history, values):
            history[name].append(float(value))
        print(
            f"Epoch {epoch + 1}/{spec.epochs} - {clock.epoch_seconds[-1]:.1f}s"
            f" (validation {clock.validation_seconds[-1]:.1f}s)"
            f" - loss: {history['loss'][-1]:.4f} - accuracy: {history['accuracy'][-1]:.4f}"
            f" - val_loss: {history['val_loss'][-1]:.4f} - val_accuracy: {val_accuracy:.4f}"
            + (f" - {describe_epoch()}" if describe_epoch else ""),
            flush=True,
        )
        checkpoint.epoch_done(epoch + 1)
        if clock.reached:
            break
    return history


def worker_rate(batch: int, steps: int, seconds: float) -> dict[str, float]:
    """One worker's part: the steps it ran, its examples/s and its time per step."""
    if not steps:  # a retry that resumed after the last epoch
        return {"steps": 0, "examples_per_second": 0.0, "step_seconds": None}
    return {"steps": steps, "examples_per_second": batch * steps / seconds, "step_seconds": seconds / steps}


def training_record(
    spec: RunSpec,
    *,
    steps: int,
    replicas_in_sync: int,
    history: dict[str, list[float]],
    lr_per_epoch: list[float],
    clock: TrainingClock,
    train_seconds: float,
    per_worker: dict[str, dict[str, float]],
    per_replica_batch: int | list[int] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """training.json's content common to every strategy, made right after the final weights are
    written. ``examples_per_second`` is measured over the time in epochs (validation included);
    ``whole_job_examples_per_second`` over the time from the replica's launch to
    its final weights, with ``whole_job_breakdown`` saying where that time went;
    ``per_replica_batch`` defaults to equal shares of the global batch (balanced sync gives each
    worker's)."""
    seconds = sum(clock.epoch_seconds) or train_seconds  # a retry with no epoch left trained 0 examples
    examples = spec.batch_size * clock.epochs_done * steps
    return {
        "strategy": spec.strategy,
        "replicas_in_sync": replicas_in_sync,
        "global_batch": spec.batch_size,
        "per_replica_batch": spec.batch_size // replicas_in_sync if per_replica_batch is None else per_replica_batch,
        "steps_per_epoch": steps,
        "epochs": spec.epochs,
        "history": history,
        "learning_rate_schedule": learning_rate_plan(spec, steps),
        "learning_rate_per_epoch": lr_per_epoch,
        "train_seconds": train_seconds,
        **clock.record(),
        "examples_per_second": examples / seconds,
        **clock.whole_job(examples),
        "per_worker": per_worker,
        **extra,
    }


def write_training_record(paths: RunPaths, record: dict[str, Any]) -> None:
    write_record(paths.training, record)
    print(
        f"trained {record['epochs']} epochs x {record['steps_per_epoch']} steps in {record['train_seconds']:.1f} s "
        f"({record['examples_per_second']:.0f} examples/s); model saved to {paths.model}",
        flush=True,
    )


def save_model(model: tf.keras.Model, spec: RunSpec, dataset: dict[str, Any], path, chief: bool = True) -> None:
    """Save the trained weights, and only them, at ``path`` (``*.weights.h5``), from a fresh copy
    of the model.

    The copy is plain: no optimizer, no distribution (variables sharded over parameter servers are
    concatenated back). No architecture is written: what a replica writes is untrusted, and the
    pipeline rebuilds the model from the spec (``tasks.models.trained_model``). Under multi-worker
    strategies every worker must take part in saving (it may run collectives); each writes into a
    scratch dir and only the chief's copy is moved to ``path``, whole.
    """
    plain = build_model(spec.model, dataset["input_shape"], dataset["num_classes"], spec.seed)
    # A checkpoint stores each variable whole, whatever its distribution, and restores by name.
    # Each ps writes its own shards: the scratch dir is beside ``path`` in the run directory, which
    # every replica sees (a container's /tmp is its own).
    with tempfile.TemporaryDirectory(dir=Path(path).parent, prefix=".save-") as scratch:
        prefix = tf.train.Checkpoint(model=model).write(f"{scratch}/weights")
        tf.train.Checkpoint(model=plain).read(prefix).expect_partial().assert_existing_objects_matched()
        plain.save_weights(f"{scratch}/{Path(path).name}")
        if chief:
            os.replace(f"{scratch}/{Path(path).name}", path)

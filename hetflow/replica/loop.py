"""The epoch loop every strategy runs, each with its own step: from the last checkpoint on, train an
epoch, score validation, sum both over the workers once, print a progress line, checkpoint, and
stop at the target accuracy; the chief also appends the epoch's figures to ``progress.jsonl``, which
the pipeline reads while the run trains (``hetflow.registry.live``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import tensorflow as tf

from hetflow.models.schedule import learning_rate
from hetflow.replica.checkpoint import EpochCheckpoint
from hetflow.replica.clock import TrainingClock
from hetflow.spec import RunSpec


class EpochLoop:
    """One replica's training: ``steps`` updates of ``spec.batch_size`` examples per epoch under the
    spec's learning-rate ``schedule``, timed by ``clock``; after ``run``, ``history`` holds the
    per-epoch curves and ``train_seconds`` the loop's wall time. With ``progress`` (the chief's), each
    epoch's figures are appended to that file as one JSON line."""

    def __init__(self, spec: RunSpec, steps: int, progress: Path | None = None):
        self.spec, self.steps, self.progress = spec, steps, progress
        self.schedule, self.lr_per_epoch = learning_rate(spec, steps)
        self.clock = TrainingClock(spec.training.target_accuracy)
        self.history: dict[str, list[float]] = {"loss": [], "accuracy": [], "val_loss": [], "val_accuracy": []}
        self.train_seconds = 0.0

    def one_step_at_a_time(self, train_step):
        """An epoch of ``steps`` calls of ``train_step()``, each returning this replica's part of
        (loss, correctly classified examples): the ``train_epoch`` of ``run``."""

        def train_epoch() -> tuple[float, float]:
            loss_sum, correct = 0.0, 0.0
            for _ in range(self.steps):
                loss, hits = train_step()
                self.clock.first_step_done()
                loss_sum += float(loss)
                correct += float(hits)
            return loss_sum, correct

        return train_epoch

    def run(
        self, train_epoch, score_validation, checkpoint: EpochCheckpoint, sum_over_workers=None, epoch_details=None
    ):
        """From the last checkpoint on: ``train_epoch()`` trains an epoch (telling ``clock`` when
        the first step is done) and returns this replica's part of its summed loss and correctly
        classified examples; after each epoch come ``score_validation()`` (this replica's summed
        validation loss, correct examples and examples), one ``sum_over_workers`` of all of it
        (None for one process: a single collective per epoch, none per step), a progress line
        (with ``epoch_details(epoch_seconds)``'s figures, if given: each worker's examples/s, and
        async staleness), the checkpoint, and a stop once the target
        is reached (every replica sees the same validation accuracy, so all stop together)."""
        spec, clock, history = self.spec, self.clock, self.history
        started = time.perf_counter()
        for epoch in range(checkpoint.restore(), spec.training.epochs):
            clock.on_epoch_begin(epoch)
            loss_sum, correct = train_epoch()
            clock.on_test_begin()
            sums = [loss_sum, correct, *score_validation()]
            loss_sum, correct, val_loss_sum, val_correct, val_count = (
                sum_over_workers(sums) if sum_over_workers else sums
            )
            clock.on_test_end()
            val_accuracy = val_correct / val_count
            clock.on_epoch_end(epoch, {"val_accuracy": val_accuracy})
            values = (
                loss_sum / self.steps,
                correct / (self.steps * spec.training.batch_size),
                val_loss_sum / val_count,
                val_accuracy,
            )
            for name, value in zip(history, values):
                history[name].append(float(value))
            details = epoch_details(clock.epoch_seconds[-1]) if epoch_details else {}
            suffix = (
                f" - staleness mean {details['staleness_mean']:.2f} max {details['staleness_max']}"
                if "staleness_mean" in details
                else ""
            )
            rates = details.get("worker_examples_per_second", {})
            if len(rates) > 1:  # the one line a task log shows of the epoch names each worker's part
                suffix += " - examples/s " + ", ".join(f"{worker} {rate:.0f}" for worker, rate in rates.items())
            print(
                f"Epoch {epoch + 1}/{spec.training.epochs} - {clock.epoch_seconds[-1]:.1f}s"
                f" (validation {clock.validation_seconds[-1]:.1f}s)"
                f" - loss: {history['loss'][-1]:.4f} - accuracy: {history['accuracy'][-1]:.4f}"
                f" - val_loss: {history['val_loss'][-1]:.4f} - val_accuracy: {val_accuracy:.4f}{suffix}",
                flush=True,
            )
            if self.progress is not None:
                self._record_progress(epoch, details)
            checkpoint.epoch_done(epoch + 1)
            if clock.reached:
                break
        self.train_seconds = time.perf_counter() - started

    def _record_progress(self, epoch: int, details: dict) -> None:
        """One JSON line for the epoch just done, appended and flushed at once: the pipeline reads
        the file while training goes on and takes whole lines only."""
        line = {
            "epoch": epoch + 1,
            "time": time.time(),
            **{name: values[-1] for name, values in self.history.items()},
            "learning_rate": self.lr_per_epoch[epoch],
            "epoch_seconds": self.clock.epoch_seconds[-1],
            "examples_per_second": self.steps * self.spec.training.batch_size / self.clock.epoch_seconds[-1],
            **details,
        }
        with open(self.progress, "a") as progress:
            progress.write(json.dumps(line) + "\n")


def validation_sums(predict, batches: tf.data.Dataset) -> tuple[float, float, float]:
    """Summed loss, correctly classified examples and examples of ``predict`` (images -> logits)
    over ``batches``."""
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    total_loss, correct, count = 0.0, 0, 0
    for images, labels in batches:
        logits = predict(images)
        total_loss += float(loss_fn(labels, logits))
        correct += int(tf.reduce_sum(tf.cast(tf.argmax(logits, axis=1) == labels, tf.int32)))
        count += int(tf.shape(labels)[0])
    return total_loss, float(correct), float(count)

"""Where a replica's time goes, from its launch to its final weights."""

from __future__ import annotations

import os
import time
from typing import Any


class TrainingClock:
    """Where a replica's time goes, from its launch (``HETFLOW_LAUNCH_TIME``) to its final weights,
    told by the epoch loop (``hetflow.replica.loop``; its method names are Keras callbacks').

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

"""How a spec's training is scheduled: the steps in an epoch, the learning rate over them (the
linear scaling rule with warmup) and the optimizer that follows it. Replicas train with it, and
compress fine-tunes with it."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hetflow.records import DatasetRecord
from hetflow.spec import RunSpec


def steps_per_epoch(spec: RunSpec, dataset: DatasetRecord) -> int:
    return spec.training.steps_per_epoch or max(1, dataset.splits["train"] // spec.training.batch_size)


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
    linear = spec.training.lr_scaling == "linear"
    return {
        "scaling": spec.training.lr_scaling,
        "base": spec.training.learning_rate,
        "reference_batch": spec.training.lr_reference_batch if linear else None,
        "global_batch": spec.training.batch_size,
        "peak": spec.training.learning_rate * spec.training.batch_size / spec.training.lr_reference_batch
        if linear
        else spec.training.learning_rate,
        "warmup_steps": round(spec.training.warmup_epochs * steps),
    }


def learning_rate(spec: RunSpec, steps: int) -> tuple[WarmupLinearScaling, list[float]]:
    """The schedule, and its value at the start of each epoch (logged as the effective schedule).
    The replica count plays no part (see ``learning_rate_plan``)."""
    rates = learning_rate_plan(spec, steps)
    schedule = WarmupLinearScaling(rates["base"], rates["peak"], rates["warmup_steps"])
    return schedule, [float(schedule(epoch * steps)) for epoch in range(spec.training.epochs)]


def make_optimizer(spec: RunSpec, schedule) -> tf.keras.optimizers.Optimizer:
    optimizers = {"sgd": tf.keras.optimizers.SGD, "adam": tf.keras.optimizers.Adam}
    return optimizers[spec.training.optimizer](learning_rate=schedule)

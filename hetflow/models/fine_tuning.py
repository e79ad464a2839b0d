"""Fine-tuning that stops when validation accuracy has recovered, for compress's pruning and
quantization-aware training.

The model is fitted in rounds of ``check_every`` optimizer steps (one Keras epoch each, over an
endless dataset: the batches go on where the last round stopped) and scored on the validation split
after each. From ``first_check`` steps on (pruning: once sparsity has reached its target) it stops
when the score reaches ``target_accuracy`` ("recovered"), when ``patience`` rounds have not beaten
the best ("stopped_improving", Keras' EarlyStopping, which puts the best round's weights back), or
after ``max_steps`` ("max_steps").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

log = logging.getLogger("hetflow.stages")

# Rounds without a better validation score before fine-tuning gives up (the digits' validation
# split is 180 images: one more right answer is 0.56 points, so a flat curve wanders by a point).
PATIENCE = 4


@dataclass(frozen=True)
class Recovery:
    """When a fine-tuning may stop (steps are optimizer steps)."""

    target_accuracy: float
    max_steps: int
    check_every: int
    first_check: int = 0
    patience: int = PATIENCE

    @property
    def rounds(self) -> int:
        return max(1, self.max_steps // self.check_every)


class _Checks(tf.keras.callbacks.Callback):
    """Keeps each round's validation accuracy and stops the fit once it reaches the target."""

    def __init__(self, recovery: Recovery, what: str):
        super().__init__()
        self.recovery, self.what = recovery, what
        self.scores: list[list[float]] = []
        self.recovered = False

    def on_epoch_end(self, epoch, logs=None):
        step = (epoch + 1) * self.recovery.check_every
        accuracy = float(logs["val_accuracy"])
        self.scores.append([step, accuracy])
        if step < self.recovery.first_check:
            log.info("%s: step %d, validation accuracy %.4f, not checked yet", self.what, step, accuracy)
            return
        log.info(
            "%s: step %d, validation accuracy %.4f (recovered at %.4f)",
            self.what,
            step,
            accuracy,
            self.recovery.target_accuracy,
        )
        if accuracy >= self.recovery.target_accuracy:
            self.recovered = True
            self.model.stop_training = True


def fine_tune(
    model: tf.keras.Model,
    batches: tf.data.Dataset,
    validation: tuple[np.ndarray, np.ndarray],
    recovery: Recovery,
    what: str,
    callbacks: Sequence[tf.keras.callbacks.Callback] = (),
) -> dict[str, Any]:
    """Fit the compiled ``model`` on the endless ``batches`` until ``recovery`` says stop; the record
    says how many steps it took, why it stopped and every round's validation accuracy."""
    checks = _Checks(recovery, what)
    stopping = tf.keras.callbacks.EarlyStopping(
        monitor="val_accuracy",
        mode="max",
        patience=recovery.patience,
        restore_best_weights=True,
        start_from_epoch=-(-recovery.first_check // recovery.check_every) - 1,
    )
    model.fit(
        batches,
        epochs=recovery.rounds,
        steps_per_epoch=recovery.check_every,
        validation_data=validation,
        callbacks=[*callbacks, checks, stopping],
        verbose=0,
    )
    if checks.recovered:
        stopped = "recovered"
    elif stopping.stopped_epoch > 0:
        stopped = "stopped_improving"
    else:
        stopped = "max_steps"
    record = {
        "steps": int(checks.scores[-1][0]),
        "max_steps": recovery.rounds * recovery.check_every,
        "stopped": stopped,
        "target_validation_accuracy": recovery.target_accuracy,
        "validation_accuracy": checks.scores,
    }
    log.info("%s: %s after %d steps", what, stopped.replace("_", " "), record["steps"])
    return record

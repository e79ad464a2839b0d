"""Training inside a replica: strategy, model, input pipeline, ``model.fit``, and the record of it.

Only the chief writes the model and ``training.json``; the supervising Airflow task reads them.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import tensorflow as tf

from tasks.data.pipeline import eval_input, train_input
from tasks.models import build_model, compile_model
from tasks.paths import RunPaths
from tasks.spec import RunSpec


class TrainingClock(tf.keras.callbacks.Callback):
    """Wall time per epoch and time from replica launch to the end of the first step."""

    def __init__(self, launched_at: float):
        super().__init__()
        self.launched_at = launched_at
        self.first_step_seconds: float | None = None
        self.epoch_seconds: list[float] = []
        self._epoch_start = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self.first_step_seconds is None:
            self.first_step_seconds = time.time() - self.launched_at

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_seconds.append(time.perf_counter() - self._epoch_start)


def make_strategy(spec: RunSpec) -> tf.distribute.Strategy:
    return tf.distribute.OneDeviceStrategy("/cpu:0")


def steps_per_epoch(spec: RunSpec, dataset: dict[str, Any]) -> int:
    return spec.steps_per_epoch or max(1, dataset["splits"]["train"] // spec.batch_size)


def train(spec: RunSpec, dataset: dict[str, Any], paths: RunPaths) -> dict[str, Any]:
    launched_at = float(os.environ.get("HETFLOW_LAUNCH_TIME", time.time()))
    strategy = make_strategy(spec)
    with strategy.scope():
        model = build_model(spec.model, dataset["input_shape"], dataset["num_classes"], spec.seed)
        compile_model(model, spec.optimizer, spec.learning_rate)
    steps = steps_per_epoch(spec, dataset)
    batches = train_input(dataset, per_worker_batch=spec.batch_size, shuffle=spec.shuffle, seed=spec.seed)
    clock = TrainingClock(launched_at)
    started = time.perf_counter()
    history = model.fit(
        batches,
        epochs=spec.epochs,
        steps_per_epoch=steps,
        validation_data=eval_input(dataset, "validation"),
        callbacks=[clock],
        verbose=2,  # one line per epoch: readable in the Airflow task log
    )
    train_seconds = time.perf_counter() - started
    model.save(paths.model)
    examples = spec.epochs * steps * spec.batch_size
    record = {
        "strategy": spec.strategy,
        "replicas": strategy.num_replicas_in_sync,
        "global_batch": spec.batch_size,
        "steps_per_epoch": steps,
        "epochs": spec.epochs,
        "history": {name: [float(v) for v in values] for name, values in history.history.items()},
        "epoch_seconds": clock.epoch_seconds,
        "train_seconds": train_seconds,
        "time_to_first_step_seconds": clock.first_step_seconds,
        "examples_per_second": examples / train_seconds,
    }
    paths.training.write_text(json.dumps(record, indent=2))
    print(
        f"trained {spec.epochs} epochs x {steps} steps in {train_seconds:.1f} s "
        f"({record['examples_per_second']:.0f} examples/s); model saved to {paths.model}",
        flush=True,
    )
    return record

"""The ``baseline`` case of ``bench/run.py``: a plain single-process ``model.fit``, no hetflow cluster.

Same dataset, model, optimizer, input pipeline and validation as a hetflow replica, and timed the
way a replica times itself (see ``FitClock``), but no strategy, no replica process and
TensorFlow's default threads: the reference every distributed case is compared with. Prints one
JSON object, shaped like a replica's training.json, on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

# hetflow's modules first: importing ``tasks`` selects tf_keras, which must happen before
# TensorFlow's own import (so ``tf.keras`` below is the same Keras the replicas use).
from tasks.data.pipeline import eval_input, train_input
from tasks.data.prepare import prepare_dataset
from tasks.models import build_model, compile_model
from tasks.paths import data_dir

# isort: split
import tensorflow as tf


class FitClock(tf.keras.callbacks.Callback):
    """What a hetflow replica's clock records: wall time per epoch (validation included) and the
    time from process launch (``HETFLOW_LAUNCH_TIME``, set by bench/run.py) to the end of the
    first training step. Kept here rather than imported, so the baseline depends on no strategy code."""

    def __init__(self):
        super().__init__()
        self.launched_at = float(os.environ["HETFLOW_LAUNCH_TIME"])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--steps-per-epoch", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--optimizer", required=True)
    parser.add_argument("--learning-rate", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args()

    dataset = prepare_dataset(args.dataset, data_dir())
    model = build_model(args.model, dataset["input_shape"], dataset["num_classes"], args.seed)
    optimizers = {"sgd": tf.keras.optimizers.SGD, "adam": tf.keras.optimizers.Adam}
    compile_model(model, optimizers[args.optimizer](learning_rate=args.learning_rate))
    batches = train_input(dataset, per_worker_batch=args.batch_size, shuffle=True, seed=args.seed)
    clock = FitClock()
    # Timed as a replica times its fit (examples over the time spent in epochs), so the numbers compare.
    started = time.perf_counter()
    model.fit(
        batches,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        validation_data=eval_input(dataset, "validation"),
        callbacks=[clock],
        verbose=2,
    )
    train_seconds = time.perf_counter() - started
    record = {
        "strategy": "none (plain model.fit)",
        "global_batch": args.batch_size,
        "steps_per_epoch": args.steps_per_epoch,
        "epochs": args.epochs,
        "epoch_seconds": clock.epoch_seconds,
        "train_seconds": train_seconds,
        "time_to_first_step_seconds": clock.first_step_seconds,
        "examples_per_second": args.epochs * args.steps_per_epoch * args.batch_size / sum(clock.epoch_seconds),
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()

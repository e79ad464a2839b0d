"""The ``baseline`` case of ``bench/run.py``: a plain single-process ``model.fit``, no hetflow cluster.

Same dataset, model, optimizer, input pipeline and validation as a hetflow replica, timed by the
same clock (``TrainingClock``: from the launch ``HETFLOW_LAUNCH_TIME``, set by bench/run.py, to
the final weights written), but no strategy, no replica process and TensorFlow's default threads:
the reference every distributed case is compared with. Prints one JSON object, shaped like a
replica's training.json, on its last line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

# hetflow's modules first: importing ``tasks`` selects tf_keras, which must happen before
# TensorFlow's own import (so ``tf.keras`` below is the same Keras the replicas use).
from hetflow.data.pipeline import eval_input, train_input
from hetflow.data.prepare import prepare_dataset
from hetflow.models.architectures import build_model, compile_model
from hetflow.paths import data_dir
from hetflow.replica.clock import TrainingClock

# isort: split
import tensorflow as tf


class FitClock(tf.keras.callbacks.Callback):
    """hetflow's ``TrainingClock``, told by ``model.fit`` (its method names are Keras callbacks'),
    for the cases that train with ``model.fit``. Put it before a checkpointing callback, so that
    checkpoints fall between epochs."""

    def __init__(self, clock: TrainingClock):
        super().__init__()
        self.clock = clock
        self.on_epoch_begin = clock.on_epoch_begin
        self.on_test_begin = clock.on_test_begin
        self.on_test_end = clock.on_test_end
        self.on_epoch_end = clock.on_epoch_end

    def on_train_batch_end(self, batch, logs=None):
        self.clock.first_step_done()


def job_parser(description: str) -> argparse.ArgumentParser:
    """The job every case outside ``hetflow train`` is given by bench/run.py (this one and the peer's)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--steps-per-epoch", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True, help="per worker")
    parser.add_argument("--optimizer", required=True)
    parser.add_argument("--learning-rate", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    return parser


def main() -> None:
    args = job_parser(__doc__).parse_args()

    dataset = prepare_dataset(args.dataset, data_dir())
    model = build_model(args.model, dataset.input_shape, dataset.num_classes, args.seed)
    optimizers = {"sgd": tf.keras.optimizers.SGD, "adam": tf.keras.optimizers.Adam}
    compile_model(model, optimizers[args.optimizer](learning_rate=args.learning_rate))
    batches = train_input(dataset, per_worker_batch=args.batch_size, shuffle=True, seed=args.seed)
    clock = TrainingClock()
    started = time.perf_counter()
    model.fit(
        batches,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        validation_data=eval_input(dataset, "validation"),
        callbacks=[FitClock(clock)],
        verbose=2,
    )
    train_seconds = time.perf_counter() - started
    examples = args.epochs * args.steps_per_epoch * args.batch_size
    with tempfile.TemporaryDirectory() as scratch:  # written as a replica writes its final weights
        model.save_weights(str(Path(scratch) / "model.weights.h5"))
        whole_job = clock.whole_job(examples)
    record = {
        "strategy": "none (plain model.fit)",
        "global_batch": args.batch_size,
        "steps_per_epoch": args.steps_per_epoch,
        "epochs": args.epochs,
        "train_seconds": train_seconds,
        **clock.record(),
        "examples_per_second": examples / sum(clock.epoch_seconds),
        **whole_job,
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()

"""The ``ray_2w`` case of ``bench/run.py``: the job of ``mwms_2`` under a peer, Ray Train.

Same dataset, model (seed, optimizer), per-worker batch, steps and validation as hetflow's
multi_worker_mirrored workers (hetflow/replica/sync.py), trained as Ray's guides train Keras:
``model.fit`` under ``MultiWorkerMirroredStrategy`` (built from the ``TF_CONFIG`` Ray sets) by Ray
Train's ``TensorflowTrainer`` on 2 Ray workers (one TensorFlow thread each, not pinned). Per epoch, in place of
hetflow's per-epoch checkpoint, Ray's own way: every worker writes a checkpoint (model and optimizer)
and ``ray.train.report`` persists rank 0's to the run's storage. Rank 0 is timed by hetflow's
``TrainingClock`` from the launch (``HETFLOW_LAUNCH_TIME``, set by bench/run.py before this process
starts, so Ray's start-up counts as hetflow's process launch does) to its final weights written.
Prints one JSON object, shaped like a replica's training.json, on its last line.

Needs Ray (bench/ray-requirements.lock, which bench/run.py installs into .bench-ray on first use).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

# hetflow's modules first: importing ``tasks`` selects tf_keras before TensorFlow's own import (Ray
# sets the same TF_USE_LEGACY_KERAS in its workers).
from hetflow.data.pipeline import eval_input, train_input
from hetflow.data.prepare import prepare_dataset
from hetflow.models.architectures import build_model, compile_model
from hetflow.paths import data_dir, hetflow_home
from hetflow.replica.clock import TrainingClock

# isort: split
import ray
import ray.train
import tensorflow as tf
from baseline import FitClock, job_parser  # bench/<name>.py scripts run with bench/ on sys.path
from ray.train.tensorflow import TensorflowTrainer


class ReportEachEpoch(tf.keras.callbacks.Callback):
    """Ray Train's per-epoch checkpoint, as its guides write one: every worker saves (under
    multi_worker_mirrored saving may run collectives), rank 0's copy is reported and persisted,
    the others' are scratch. Every worker reports: ``ray.train.report`` is a barrier."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def on_epoch_end(self, epoch, logs=None):
        with tempfile.TemporaryDirectory(prefix="ray-peer-checkpoint-") as directory:
            tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer).write(f"{directory}/checkpoint")
            checkpoint = ray.train.Checkpoint.from_directory(directory) if self.rank == 0 else None
            metrics = {name: float(value) for name, value in (logs or {}).items()}
            ray.train.report({"epoch": epoch + 1, **metrics}, checkpoint=checkpoint)


def train_loop(config: dict[str, Any]) -> None:
    """One Ray worker: the job of a hetflow mwms worker (hetflow/replica/sync.py), with model.fit."""
    # One thread, as hetflow's replica_threads=1; before TensorFlow runs its first op.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    os.environ["HETFLOW_LAUNCH_TIME"] = config["launched_at"]  # what TrainingClock times from
    rank = ray.train.get_context().get_world_rank()
    dataset = config["dataset"]
    # From the TF_CONFIG Ray set; ring all-reduce as hetflow's (what AUTO picks on CPUs anyway).
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING
        )
    )
    global_batch = config["per_worker_batch"] * strategy.num_replicas_in_sync
    with strategy.scope():
        model = build_model(config["model"], dataset.input_shape, dataset.num_classes, config["seed"])
        compile_model(model, tf.keras.optimizers.Adam(learning_rate=config["learning_rate"]))

    def worker_batches(context: tf.distribute.InputContext) -> tf.data.Dataset:
        return train_input(
            dataset,
            per_worker_batch=context.get_per_replica_batch_size(global_batch),
            shuffle=True,
            seed=config["seed"],
            num_workers=context.num_input_pipelines,
            worker_index=context.input_pipeline_id,
        )

    # As hetflow: every worker validates its share of the validation split; Keras sums the metrics.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    clock = TrainingClock()
    started = time.perf_counter()
    model.fit(
        strategy.distribute_datasets_from_function(worker_batches),
        epochs=config["epochs"],
        steps_per_epoch=config["steps_per_epoch"],
        validation_data=eval_input(dataset, "validation").with_options(options),
        callbacks=[FitClock(clock), ReportEachEpoch(rank)],  # clock first: checkpoints fall between epochs
        verbose=2 if rank == 0 else 0,
    )
    train_seconds = time.perf_counter() - started
    # Every worker saves (reading the weights runs collectives under multi_worker_mirrored: rank 0
    # alone would wait forever); rank 0's are the job's, the others' scratch.
    with tempfile.TemporaryDirectory(prefix="ray-peer-weights-") as scratch:
        model.save_weights(config["weights_path"] if rank == 0 else f"{scratch}/model.weights.h5")
    if rank != 0:
        return
    examples = config["epochs"] * config["steps_per_epoch"] * global_batch
    whole_job = clock.whole_job(examples)
    record = {
        "strategy": "multi_worker_mirrored under ray.train.tensorflow.TensorflowTrainer",
        "ray": ray.__version__,
        "replicas_in_sync": strategy.num_replicas_in_sync,
        "global_batch": global_batch,
        "steps_per_epoch": config["steps_per_epoch"],
        "epochs": config["epochs"],
        "train_seconds": train_seconds,
        **clock.record(),
        "examples_per_second": examples / sum(clock.epoch_seconds),
        **whole_job,
        # Which workers ran: evidence the case ran what it says it did.
        "cluster": [
            f"worker-{i} {address}"
            for i, address in enumerate(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
        ],
    }
    Path(config["record_path"]).write_text(json.dumps(record))


def main() -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--workers", type=int, required=True)
    args = parser.parse_args()
    launched_at = os.environ.get("HETFLOW_LAUNCH_TIME") or repr(time.time())

    dataset = prepare_dataset(args.dataset, data_dir())
    # Ray's session files (sockets, logs) and the run's storage in places of this run's own, gone
    # with it: the session dir is short-named in /tmp, as unix socket paths must be short.
    with (
        tempfile.TemporaryDirectory(prefix="ray-") as session,
        tempfile.TemporaryDirectory(dir=hetflow_home(), prefix="ray-peer-") as storage,
    ):
        ray.init(_temp_dir=session)
        trainer = TensorflowTrainer(
            train_loop,
            train_loop_config={
                "launched_at": launched_at,
                "dataset": dataset,
                "model": args.model,
                "seed": args.seed,
                "learning_rate": args.learning_rate,
                "per_worker_batch": args.batch_size,
                "epochs": args.epochs,
                "steps_per_epoch": args.steps_per_epoch,
                "weights_path": f"{storage}/model.weights.h5",
                "record_path": f"{storage}/training.json",
            },
            scaling_config=ray.train.ScalingConfig(num_workers=args.workers, use_gpu=False),
            run_config=ray.train.RunConfig(name="ray_2w", storage_path=storage),
        )
        trainer.fit()
        record = json.loads(Path(storage, "training.json").read_text())
        # Beside the whole job (to rank 0's final weights, as hetflow's): until fit() returned here.
        record["fit_returned_after_seconds"] = time.time() - float(launched_at)
        ray.shutdown()
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()

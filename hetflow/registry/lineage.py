"""What a model was trained on and how training went, in the forms MLflow and TensorFlow users open
first: the dataset as an MLflow dataset input (the run page's dataset panel), the curves as
TensorBoard event files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from mlflow.data.dataset_source_registry import get_dataset_source_from_json
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag
from mlflow.types import Schema, TensorSpec

from hetflow.records import DatasetRecord
from hetflow.replica.training_json import TrainingRecord
from mlflow import MlflowClient

# MLflow stores a dataset digest in 36 characters; the full fingerprint is in the run's tags.
_DIGEST_CHARS = 36


def dataset_input(dataset: DatasetRecord) -> DatasetInput:
    """The prepared dataset as an MLflow dataset input: name, version, fingerprint as digest, the
    source it was prepared from, and the schema the model reads (raw uint8 images, int64 labels)."""
    schema = Schema(
        [
            TensorSpec(np.dtype(np.uint8), (-1, *dataset.input_shape), "image"),
            TensorSpec(np.dtype(np.int64), (-1,), "label"),
        ]
    )
    meta = MetaDataset(
        # A folder of images is its own source; a TFDS dataset's is its prepared copy under data_dir.
        # Named as the local path it is: resolving the path would find MLflow's two local sources
        # (its "" and "file" schemes) and warn that it "can be interpreted in multiple ways".
        get_dataset_source_from_json(json.dumps({"uri": dataset.source_path}), "local"),
        name=f"{dataset.name}@{dataset.version}",
        digest=dataset.fingerprint[:_DIGEST_CHARS],
        schema=schema,
    )
    return DatasetInput(meta._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", "training")])


def log_dataset(client: MlflowClient, run_id: str, dataset: DatasetRecord) -> None:
    """Safe to repeat: MLflow keeps one input per (dataset, digest) and run."""
    client.log_inputs(run_id, datasets=[dataset_input(dataset)])


def write_tensorboard_events(training: TrainingRecord, log_dir: Path) -> Path:
    """The per-epoch curves as TensorBoard event files, laid out as Keras's TensorBoard callback
    writes them (``train/`` and ``validation/``, tags ``epoch_<metric>``, step = epoch), so that
    ``tensorboard --logdir`` on the downloaded artifact shows what a Keras user expects. The folder
    is written afresh, so a retried task leaves one copy of each curve."""
    import tensorflow as tf

    shutil.rmtree(log_dir, ignore_errors=True)
    runs: dict[str, dict[str, list[float]]] = {"train": {}, "validation": {}}
    for name, values in dict(training.history).items():
        if name.startswith("val_"):
            runs["validation"][f"epoch_{name[len('val_') :]}"] = values
        else:
            runs["train"][f"epoch_{name}"] = values
    runs["train"]["epoch_learning_rate"] = training.learning_rate_per_epoch
    runs["train"]["epoch_seconds"] = training.epoch_seconds
    for run, series in runs.items():
        writer = tf.summary.create_file_writer(str(log_dir / run))
        with writer.as_default():
            for tag, values in series.items():
                for epoch, value in enumerate(values):  # Keras counts epochs from 0 in its event files
                    tf.summary.scalar(tag, value, step=epoch)
        writer.close()
    return log_dir

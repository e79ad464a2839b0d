"""The trained weights, written once at the end of training."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import tensorflow as tf

from hetflow.models.architectures import build_model
from hetflow.records import DatasetRecord
from hetflow.spec import RunSpec


def save_model(model: tf.keras.Model, spec: RunSpec, dataset: DatasetRecord, path, chief: bool = True) -> None:
    """Save the trained weights, and only them, at ``path`` (``*.weights.h5``), from a fresh copy
    of the model.

    The copy is plain: no optimizer, no distribution (variables sharded over parameter servers are
    concatenated back). No architecture is written: what a replica writes is untrusted, and the
    pipeline rebuilds the model from the spec (``hetflow.models.architectures.trained_model``). Under multi-worker
    strategies every worker must take part in saving (it may run collectives); each writes into a
    scratch dir and only the chief's copy is moved to ``path``, whole.
    """
    plain = build_model(spec.model.architecture, dataset.input_shape, dataset.num_classes, spec.training.seed)
    # A checkpoint stores each variable whole, whatever its distribution, and restores by name.
    # Each ps writes its own shards: the scratch dir is beside ``path`` in the run directory, which
    # every replica sees (a container's /tmp is its own).
    with tempfile.TemporaryDirectory(dir=Path(path).parent, prefix=".save-") as scratch:
        prefix = tf.train.Checkpoint(model=model).write(f"{scratch}/weights")
        tf.train.Checkpoint(model=plain).read(prefix).expect_partial().assert_existing_objects_matched()
        plain.save_weights(f"{scratch}/{Path(path).name}")
        if chief:
            os.replace(f"{scratch}/{Path(path).name}", path)

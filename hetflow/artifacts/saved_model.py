"""The SavedModel that serves a trained model: written by export, and by register when
``export_formats`` asked for none (the registry serves one whatever was exported)."""

from __future__ import annotations

import shutil
from pathlib import Path

import tensorflow as tf


def save_serving_model(model: tf.keras.Model, path: Path) -> None:
    """SavedModel whose ``serving_default`` takes raw uint8 images and returns logits."""
    input_shape = model.input_shape[1:]

    @tf.function(input_signature=[tf.TensorSpec([None, *input_shape], tf.uint8, name="image")])
    def serve(image):
        return {"logits": model(image, training=False)}

    if path.exists():
        shutil.rmtree(path)  # a retried task writes it anew
    tf.saved_model.save(model, str(path), signatures={"serving_default": serve})

"""Converting a trained model to a TFLite file, plain (export) or quantized (compress)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from tasks.data.pipeline import split_arrays

REPRESENTATIVE_EXAMPLES = 200


def representative_images(dataset: dict[str, Any], seed: int) -> np.ndarray:
    """The int8 calibration sample: ``REPRESENTATIVE_EXAMPLES`` train images drawn with ``seed``."""
    images, _ = split_arrays(dataset, "train")
    return np.random.default_rng(seed).permutation(images)[:REPRESENTATIVE_EXAMPLES]


def to_tflite(model: tf.keras.Model, quantize: str, representative: np.ndarray | None = None) -> bytes:
    """The model as a TFLite flatbuffer; ``representative`` calibrates ``quantize="int8"`` only."""
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    if quantize != "none":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if quantize == "float16":
        converter.target_spec.supported_types = [tf.float16]
    if quantize == "int8":
        converter.representative_dataset = lambda: ([image[np.newaxis]] for image in representative)
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        converter.inference_input_type = tf.uint8  # raw pixels in, as the float model takes them
    return converter.convert()

"""An exported artifact loaded back from disk the way a consumer would load it, as a function from
raw uint8 images to logits: a SavedModel with ``tf.saved_model.load``, a TFLite file with the
LiteRT interpreter of ``ai-edge-litert``; and the Keras model they were made from, as the same kind
of function."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter


def keras_predictor(model: tf.keras.Model) -> Callable[[np.ndarray], np.ndarray]:
    """``model``'s logits for one batch, from Keras's predict function (what ``model.predict`` computes
    batch by batch). Not ``model.predict`` once per batch: each call keeps about 2 MB (measured: 41 MB
    more after 22 more batches of a test split), so memory grew with the split."""
    return lambda images: np.asarray(model.predict_on_batch(images))


def saved_model_predictor(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    serve = tf.saved_model.load(str(path)).signatures["serving_default"]
    return lambda images: serve(image=tf.constant(images))["logits"].numpy()


def tflite_predictor(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    """Logits from the LiteRT interpreter, for any batch size (the input is resized to fit)."""
    interpreter = Interpreter(model_path=str(path))
    input_index = interpreter.get_input_details()[0]["index"]
    output_index = interpreter.get_output_details()[0]["index"]
    shape = None

    def predict(images: np.ndarray) -> np.ndarray:
        nonlocal shape
        if images.shape != shape:
            interpreter.resize_tensor_input(input_index, images.shape)
            interpreter.allocate_tensors()
            shape = images.shape
        interpreter.set_tensor(input_index, images)
        interpreter.invoke()
        return interpreter.get_tensor(output_index).copy()

    return predict

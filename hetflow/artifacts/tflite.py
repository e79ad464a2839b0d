"""Converting a trained model to a TFLite file, plain (export) or quantized (compress), and reading
back from a file how its weights are encoded.

A pruned model's zeros make the file smaller only when the converter is asked to encode them
(``tf.lite.Optimize.EXPERIMENTAL_SPARSITY``): without it the pruned file has the bytes of the dense
one. Measured here (TF 2.21, ai-edge-litert): the converter encodes a float kernel in any pattern,
and the interpreter runs it (a DENSIFY op before the layer); an int8 FULLY_CONNECTED kernel runs
only in 1x16 blocks (TFLite's layout, output x input: 16 consecutive inputs of one unit), any other
pattern fails to prepare in the XNNPACK delegate; a sparse ``dynamic`` file failed to prepare
(Conv2D) or computed something else (Dense in 1x16 blocks: argmax agreement with the Keras model
6 %, 98 % for the same model's dense ``dynamic`` file), so ``dynamic`` and ``float16`` files stay
dense.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import tensorflow as tf
from ai_edge_litert import schema_py_generated as schema

from hetflow.data.pipeline import split_images_at
from hetflow.records import DatasetRecord
from hetflow.spec.sections import CALIBRATION_EXAMPLES

SPARSE_ENCODABLE = ("none", "int8")


def representative_images(dataset: DatasetRecord, seed: int, count: int = CALIBRATION_EXAMPLES) -> np.ndarray:
    """The int8 calibration sample: ``count`` train images (all of them where the split has fewer)
    at positions drawn with ``seed``, gathered in one pass over the split. Its memory is the sample's
    images and the drawn permutation's 8 bytes per training example: the sample stays the one the
    whole-split code drew (the first ``count`` of ``default_rng(seed).permutation``), whose int8
    figures are recorded."""
    positions = np.random.default_rng(seed).permutation(dataset.splits["train"])[:count]
    return split_images_at(dataset, "train", positions)


def to_tflite(
    model: tf.keras.Model, quantize: str, representative: np.ndarray | None = None, sparse: bool = False
) -> bytes:
    """The model as a TFLite flatbuffer; ``representative`` calibrates ``quantize="int8"`` only;
    ``sparse`` asks the converter to encode zero weights compactly (``quantize`` in ``SPARSE_ENCODABLE``)."""
    if sparse and quantize not in SPARSE_ENCODABLE:
        raise ValueError(f"quantize={quantize} has no sparse encoding: expected one of {', '.join(SPARSE_ENCODABLE)}")
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    optimizations = [tf.lite.Optimize.DEFAULT] if quantize != "none" else []
    if sparse:
        optimizations.append(tf.lite.Optimize.EXPERIMENTAL_SPARSITY)
    converter.optimizations = optimizations
    if quantize == "float16":
        converter.target_spec.supported_types = [tf.float16]
    if quantize == "int8":
        converter.representative_dataset = lambda: ([image[np.newaxis]] for image in representative)
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        converter.inference_input_type = tf.uint8  # raw pixels in, as the float model takes them
    with warnings.catch_warnings():
        # TensorFlow asks for quantized_input_stats whenever the input type is quantized, but with a
        # representative dataset the input's scale comes from calibration (the int8 files' accuracy
        # on the test split is within a point of the float model's: bench/COMPRESSION.md).
        warnings.filterwarnings("ignore", message="Statistics for quantized inputs were expected")
        return converter.convert()


def weight_encoding(flatbuffer: bytes) -> dict[str, Any]:
    """How the file stores its weights, read from the flatbuffer itself: ``sparse`` when some tensor
    carries sparsity metadata, with each such tensor's name, shape and block shape (None: element-wise)."""
    model = schema.ModelT.InitFromPackedBuf(flatbuffer, 0)
    tensors = []
    for subgraph in model.subgraphs:
        for tensor in subgraph.tensors:
            if tensor.sparsity is None:
                continue
            block = None
            if tensor.sparsity.blockMap is not None and len(tensor.sparsity.blockMap):
                # Each blocked dimension adds one metadata entry after the tensor's own, its block size.
                block = [1] * len(tensor.shape)
                extra = tensor.sparsity.dimMetadata[len(tensor.shape) :]
                for dimension, metadata in zip(tensor.sparsity.blockMap, extra):
                    block[int(dimension)] = int(metadata.denseSize)
            tensors.append({"name": tensor.name.decode(), "shape": [int(d) for d in tensor.shape], "block": block})
    return {"encoding": "sparse" if tensors else "dense", "sparse_tensors": tensors}

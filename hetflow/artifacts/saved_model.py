"""The SavedModel that serves a trained model: written by export, and by register when
``export_formats`` asked for none (the registry serves one whatever was exported).

It carries TensorFlow Serving's warm-up file, ``assets.extra/tf_serving_warmup_requests``: a TFRecord of
``PredictionLog``s, each a ``PredictRequest`` of real test images for ``serving_default``, which TF
Serving replays when it loads the version, before the version takes traffic (its first requests
otherwise pay for tracing and allocation)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import tensorflow as tf

from hetflow.data.pipeline import split_head
from hetflow.records import DatasetRecord

SIGNATURE, INPUT, OUTPUT = "serving_default", "image", "logits"
WARMUP_FILE = Path("assets.extra") / "tf_serving_warmup_requests"
# Requests of one example each, then one of them all: TF Serving warms the shapes it will see,
# a phone-sized request and a batch.
WARMUP_EXAMPLES = 8


def save_serving_model(model: tf.keras.Model, path: Path, dataset: DatasetRecord | None = None) -> None:
    """SavedModel whose ``serving_default`` takes raw uint8 images and returns logits, with TF
    Serving's warm-up requests made of ``dataset``'s first test images (none without a dataset: a
    test's model trained on none)."""
    input_shape = model.input_shape[1:]

    @tf.function(input_signature=[tf.TensorSpec([None, *input_shape], tf.uint8, name=INPUT)])
    def serve(image):
        return {OUTPUT: model(image, training=False)}

    if path.exists():
        shutil.rmtree(path)  # a retried task writes it anew
    tf.saved_model.save(model, str(path), signatures={SIGNATURE: serve})
    if dataset is not None:
        images, _ = split_head(dataset, "test", WARMUP_EXAMPLES)
        write_warmup_requests(path, images[:WARMUP_EXAMPLES])


def write_warmup_requests(saved_model: Path, images: np.ndarray) -> Path:
    """``saved_model``'s warm-up file: one request per image of ``images``, then one of them all."""
    from tensorflow_serving.apis import model_pb2, predict_pb2, prediction_log_pb2

    target = saved_model / WARMUP_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    batches = [images[i : i + 1] for i in range(len(images))] + [images]
    with tf.io.TFRecordWriter(str(target)) as writer:
        for batch in batches:
            request = predict_pb2.PredictRequest(model_spec=model_pb2.ModelSpec(signature_name=SIGNATURE))
            request.inputs[INPUT].CopyFrom(tf.make_tensor_proto(np.ascontiguousarray(batch, dtype=np.uint8)))
            log = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request))
            writer.write(log.SerializeToString())
    return target

"""export: a SavedModel for serving, and every artifact re-loaded and scored on the test split.

Each artifact is loaded back from disk the way a consumer would (``tf.saved_model.load``; the
LiteRT interpreter of ``ai-edge-litert`` for TFLite) and scored on the whole test split: accuracy,
agreement with the float model, size raw and gzipped, latency per example at batch 1. Float
artifacts must reproduce the float model (parity); a compressed variant more than
``max_accuracy_drop`` below the float model is rejected, not deployable.
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import tarfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter

from tasks import plots
from tasks.data.pipeline import split_arrays
from tasks.models import trained_model
from tasks.paths import RunPaths, write_record
from tasks.spec import RunSpec

LATENCY_EXAMPLES = 200
# Float artifacts compute what the float model computes, up to float rounding.
PARITY_TOLERANCE = 1e-3


class ParityError(RuntimeError):
    pass


def save_serving_model(model: tf.keras.Model, path: Path) -> None:
    """SavedModel whose ``serving_default`` takes raw uint8 images and returns logits."""
    input_shape = model.input_shape[1:]

    @tf.function(input_signature=[tf.TensorSpec([None, *input_shape], tf.uint8, name="image")])
    def serve(image):
        return {"logits": model(image, training=False)}

    if path.exists():
        shutil.rmtree(path)  # a retried task writes it anew
    tf.saved_model.save(model, str(path), signatures={"serving_default": serve})


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


def _latency_ms(predict: Callable[[np.ndarray], np.ndarray], images: np.ndarray) -> float:
    """Median wall time of one example at batch 1, after one warm-up call."""
    predict(images[:1])
    times = []
    for image in images[:LATENCY_EXAMPLES]:
        started = time.perf_counter()
        predict(image[np.newaxis])
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1000)


def _sizes(path: Path) -> dict[str, int]:
    """Bytes on disk, and gzipped (a directory as a gzipped tar)."""
    if path.is_dir():
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            archive.add(path, arcname=path.name)
        files = [p for p in path.rglob("*") if p.is_file()]
        return {"bytes": sum(p.stat().st_size for p in files), "gzip_bytes": len(buffer.getvalue())}
    data = path.read_bytes()
    return {"bytes": len(data), "gzip_bytes": len(gzip.compress(data))}


def score(
    predict: Callable[[np.ndarray], np.ndarray], images: np.ndarray, labels: np.ndarray, float_logits: np.ndarray
) -> dict[str, float]:
    logits = predict(images)
    predicted = np.argmax(logits, axis=1)
    return {
        "test_accuracy": float(np.mean(predicted == labels)),
        "agreement_with_float": float(np.mean(predicted == np.argmax(float_logits, axis=1))),
        "max_logit_difference": float(np.max(np.abs(logits - float_logits))),
        "latency_ms": _latency_ms(predict, images),
    }


def judge(artifacts: dict[str, dict[str, Any]], float_accuracy: float, max_accuracy_drop: float) -> str | None:
    """Check parity of the float artifacts, accept or reject each by its accuracy drop, and pick
    the TFLite variant to deploy: the smallest accepted one (None if none is accepted)."""
    for name, artifact in artifacts.items():
        is_float = artifact["format"] == "saved_model" or artifact.get("variant") == "float"
        if is_float and artifact["max_logit_difference"] > PARITY_TOLERANCE:
            raise ParityError(
                f"{name} does not reproduce the float model: logits differ by up to "
                f"{artifact['max_logit_difference']:.2e} (> {PARITY_TOLERANCE}) on the test split"
            )
        drop = float_accuracy - artifact["test_accuracy"]
        artifact["accuracy_drop"] = drop
        artifact["accepted"] = drop <= max_accuracy_drop
        if not artifact["accepted"]:
            artifact["reason"] = f"accuracy drop {drop:.4f} > max_accuracy_drop {max_accuracy_drop}"
    deployable = [n for n, a in artifacts.items() if a["format"] == "tflite" and a["accepted"]]
    return min(deployable, key=lambda n: artifacts[n]["gzip_bytes"]) if deployable else None


def export(spec: RunSpec, paths: RunPaths, dataset: dict[str, Any]) -> dict[str, Any]:
    model = trained_model(spec, dataset, paths.model)
    images, labels = split_arrays(dataset, "test")
    float_logits = model.predict(images, batch_size=256, verbose=0)
    float_accuracy = float(np.mean(np.argmax(float_logits, axis=1) == labels))
    compression = json.loads(paths.compression.read_text())

    artifacts: dict[str, dict[str, Any]] = {}
    if "saved_model" in spec.export_formats:
        save_serving_model(model, paths.saved_model)
        artifacts["saved_model"] = {
            "format": "saved_model",
            "path": str(paths.saved_model),
            "weights_bytes": sum(p.stat().st_size for p in (paths.saved_model / "variables").iterdir()),
            **_sizes(paths.saved_model),
            **score(saved_model_predictor(paths.saved_model), images, labels, float_logits),
        }
    for name, variant in compression["variants"].items():
        path = Path(variant["path"])
        artifacts[f"tflite_{name}"] = {
            "format": "tflite",
            "variant": name,
            "quantize": variant["quantize"],
            "pruned": variant["base"] == "pruned",
            "path": str(path),
            **_sizes(path),
            **score(tflite_predictor(path), images, labels, float_logits),
        }

    record = {
        "float_test_accuracy": float_accuracy,
        "artifacts": artifacts,
        "chosen_tflite": judge(artifacts, float_accuracy, spec.max_accuracy_drop),
    }
    paths.plots.mkdir(parents=True, exist_ok=True)
    plots.size_vs_accuracy(artifacts, float_accuracy, paths.plots / "size_vs_accuracy.png")
    write_record(paths.export, record)
    return record

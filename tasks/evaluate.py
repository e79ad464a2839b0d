"""evaluate: test-split loss and accuracy of the trained model, and the run's plots."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import tensorflow as tf

from tasks import plots
from tasks.data.pipeline import split_arrays
from tasks.models import trained_model
from tasks.paths import RunPaths, write_record
from tasks.spec import RunSpec


def score_logits(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
    return {"test_loss": float(loss), "test_accuracy": float(np.mean(np.argmax(logits, axis=1) == labels))}


def confusion_counts(predicted: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (labels, predicted), 1)
    return matrix


def evaluate(paths: RunPaths, dataset: dict[str, Any]) -> dict[str, Any]:
    model = trained_model(RunSpec.model_validate_json(paths.spec.read_text()), dataset, paths.model)
    images, labels = split_arrays(dataset, "test")
    logits = model.predict(images, batch_size=256, verbose=0)
    result = score_logits(logits, labels)
    matrix = confusion_counts(np.argmax(logits, axis=1), labels, dataset["num_classes"])
    paths.plots.mkdir(parents=True, exist_ok=True)
    plots.confusion_matrix(matrix, result["test_accuracy"], paths.plots / "confusion_matrix.png")
    plots.training(json.loads(paths.training.read_text()), paths.plots)
    result |= {"test_examples": int(len(labels)), "confusion_matrix": matrix.tolist()}
    write_record(paths.evaluation, result)
    return result

"""evaluate: test-split loss and accuracy of the trained model, and the run's plots."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import tensorflow as tf

from hetflow import plots
from hetflow.data.pipeline import split_arrays
from hetflow.models.architectures import trained_model
from hetflow.paths import RunPaths, run_paths
from hetflow.pipeline.attempts import attempt, load_spec, reported
from hetflow.records import DatasetRecord, EvaluationRecord
from hetflow.replica.training_json import read_training

log = logging.getLogger("hetflow.stages")


@reported
def evaluate(run_id: str, try_number: int | None = None) -> dict[str, Any]:
    paths = run_paths(run_id)
    with attempt(paths, "evaluate", run_id, try_number) as receipt:
        result = evaluate_model(paths, DatasetRecord.read(paths))
    log.info("test accuracy %.4f, loss %.4f", result.test_accuracy, result.test_loss)
    return {**result.model_dump(mode="json", exclude={"confusion_matrix"}), "attempt": receipt}


def score_logits(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
    return {"test_loss": float(loss), "test_accuracy": float(np.mean(np.argmax(logits, axis=1) == labels))}


def confusion_counts(predicted: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (labels, predicted), 1)
    return matrix


def evaluate_model(paths: RunPaths, dataset: DatasetRecord) -> EvaluationRecord:
    """Score the trained model on the test split, draw the plots; writes evaluation.json."""
    spec = load_spec(paths)
    training = read_training(paths.training, spec, dataset)  # refused before the model is loaded
    model = trained_model(spec, dataset, paths.model)
    images, labels = split_arrays(dataset, "test")
    logits = model.predict(images, batch_size=256, verbose=0)
    matrix = confusion_counts(np.argmax(logits, axis=1), labels, dataset.num_classes)
    result = EvaluationRecord(
        **score_logits(logits, labels), test_examples=int(len(labels)), confusion_matrix=matrix.tolist()
    )
    paths.plots.mkdir(parents=True, exist_ok=True)
    plots.confusion_matrix(matrix, result.test_accuracy, paths.plots / "confusion_matrix.png")
    plots.training(training, paths.plots)
    result.write(paths)
    return result

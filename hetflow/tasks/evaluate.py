"""evaluate: test-split loss and accuracy of the trained model, and the run's plots."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import tensorflow as tf

from hetflow import plots
from hetflow.artifacts.predictors import keras_predictor
from hetflow.data.pipeline import split_batches
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


def scores_on_test_split(model: tf.keras.Model, dataset: DatasetRecord) -> EvaluationRecord:
    """``model``'s loss, accuracy and confusion matrix on the test split, streamed in batches. The
    loss is the mean of the examples' cross-entropies, summed in float64 as they come and given in
    float32, as Keras gave the whole split's (its float32 sum may differ from this in the last bit)."""
    predict = keras_predictor(model)
    per_example = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    matrix = np.zeros((dataset.num_classes, dataset.num_classes), dtype=np.int64)
    loss_sum, examples = 0.0, 0
    for images, labels in split_batches(dataset, "test"):
        logits = predict(images)
        loss_sum += float(np.sum(per_example(labels, logits).numpy(), dtype=np.float64))
        examples += len(labels)
        np.add.at(matrix, (labels, np.argmax(logits, axis=1)), 1)
    return EvaluationRecord(
        test_loss=float(np.float32(loss_sum / examples)),
        test_accuracy=int(np.trace(matrix)) / examples,
        test_examples=examples,
        confusion_matrix=matrix.tolist(),
    )


def evaluate_model(paths: RunPaths, dataset: DatasetRecord) -> EvaluationRecord:
    """Score the trained model on the test split, draw the plots; writes evaluation.json."""
    spec = load_spec(paths)
    training = read_training(paths.training, spec, dataset)  # refused before the model is loaded
    result = scores_on_test_split(trained_model(spec, dataset, paths.model), dataset)
    paths.plots.mkdir(parents=True, exist_ok=True)
    plots.confusion_matrix(
        np.array(result.confusion_matrix), result.test_accuracy, paths.plots / "confusion_matrix.png"
    )
    plots.training(training, paths.plots)
    result.write(paths)
    return result

"""evaluate: test-split loss and accuracy of the trained model, and a confusion-matrix plot."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import tensorflow as tf

from tasks.data.pipeline import split_arrays
from tasks.paths import RunPaths


def score_logits(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
    return {"test_loss": float(loss), "test_accuracy": float(np.mean(np.argmax(logits, axis=1) == labels))}


def confusion_matrix(predicted: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (labels, predicted), 1)
    return matrix


def plot_confusion_matrix(matrix: np.ndarray, accuracy: float, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    image = ax.imshow(matrix, cmap="Blues")
    for (row, col), count in np.ndenumerate(matrix):
        if count:
            color = "white" if count > matrix.max() / 2 else "black"
            ax.text(col, row, str(count), ha="center", va="center", fontsize=8, color=color)
    ax.set(xlabel="predicted", ylabel="true", title=f"Test confusion matrix (accuracy {accuracy:.3f})")
    ax.set_xticks(range(matrix.shape[1]))
    ax.set_yticks(range(matrix.shape[0]))
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def evaluate(paths: RunPaths, dataset: dict[str, Any]) -> dict[str, Any]:
    model = tf.keras.models.load_model(paths.model)
    images, labels = split_arrays(dataset, "test")
    logits = model.predict(images, batch_size=256, verbose=0)
    result = score_logits(logits, labels)
    matrix = confusion_matrix(np.argmax(logits, axis=1), labels, dataset["num_classes"])
    paths.plots.mkdir(parents=True, exist_ok=True)
    plot_confusion_matrix(matrix, result["test_accuracy"], paths.plots / "confusion_matrix.png")
    result |= {"test_examples": int(len(labels)), "confusion_matrix": matrix.tolist()}
    paths.evaluation.write_text(json.dumps(result, indent=2))
    return result

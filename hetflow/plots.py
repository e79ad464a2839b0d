"""The run's plots, as PNG files (attached to the MLflow run)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from hetflow.records import ExportedArtifact
from hetflow.replica.training_json import TrainingRecord


def confusion_matrix(matrix: np.ndarray, accuracy: float, path) -> None:
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


def training(record: TrainingRecord, folder: Path) -> None:
    """Loss and accuracy per epoch; examples/s per worker; the staleness histogram (async)."""
    history = dict(record.history)
    epochs = range(1, len(history["loss"]) + 1)
    fig, (loss_ax, accuracy_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for name, values in history.items():
        (accuracy_ax if "accuracy" in name else loss_ax).plot(epochs, values, label=name)
    loss_ax.set(xlabel="epoch", title="loss")
    accuracy_ax.set(xlabel="epoch", title="accuracy")
    loss_ax.legend()
    accuracy_ax.legend()
    fig.suptitle(f"{record.strategy}: training curves")
    fig.tight_layout()
    fig.savefig(folder / "training_curves.png", dpi=100)
    plt.close(fig)

    workers = record.per_worker
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(list(workers), [w.examples_per_second for w in workers.values()])
    ax.set(ylabel="examples/s", title=f"{record.strategy}: throughput per worker")
    fig.tight_layout()
    fig.savefig(folder / "worker_throughput.png", dpi=100)
    plt.close(fig)

    if record.staleness:
        histogram = record.staleness.histogram
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([int(k) for k in histogram], list(histogram.values()))
        ax.set(
            xlabel="staleness (other updates between read and apply)",
            ylabel="updates",
            title=f"staleness: mean {record.staleness.mean:.2f}, max {record.staleness.max}",
        )
        fig.tight_layout()
        fig.savefig(folder / "staleness.png", dpi=100)
        plt.close(fig)


def size_vs_accuracy(artifacts: dict[str, ExportedArtifact], float_accuracy: float, path: Path) -> None:
    """Each exported artifact: gzipped size against test accuracy; rejected ones in red."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, artifact in artifacts.items():
        color = "tab:blue" if artifact.accepted else "tab:red"
        size_kb = artifact.gzip_bytes / 1024
        ax.scatter(size_kb, artifact.test_accuracy, color=color)
        ax.annotate(name, (size_kb, artifact.test_accuracy), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(float_accuracy, color="gray", linestyle="--", linewidth=1, label="float model")
    ax.set(xlabel="size, gzipped (KiB)", ylabel="test accuracy", title="Exported variants: size vs accuracy")
    ax.set_xscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

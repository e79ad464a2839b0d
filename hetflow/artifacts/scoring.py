"""An exported artifact scored as export judges it: accuracy, agreement and largest logit difference
with the float model, latency per example at batch 1, size raw and gzipped; parity of the float
artifacts and the accept-or-reject of each variant by its accuracy drop (``judge``).

Scores are tallied batch by batch (``Tally``, ``score_split``): a split is never held whole, and
the figures are the whole split's exactly (counts, and a maximum, add up over batches)."""

from __future__ import annotations

import gzip
import io
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

Predict = Callable[[np.ndarray], np.ndarray]

LATENCY_EXAMPLES = 200
# Float artifacts compute what the float model computes, up to float rounding.
PARITY_TOLERANCE = 1e-3


class ParityError(RuntimeError):
    pass


def latency_ms(predict: Predict, images: np.ndarray) -> float:
    """Median wall time of one example at batch 1, after one warm-up call."""
    predict(images[:1])
    times = []
    for image in images[:LATENCY_EXAMPLES]:
        started = time.perf_counter()
        predict(image[np.newaxis])
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1000)


def sizes(path: Path) -> dict[str, int]:
    """Bytes on disk, and gzipped (a directory as a gzipped tar)."""
    if path.is_dir():
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            archive.add(path, arcname=path.name)
        files = [p for p in path.rglob("*") if p.is_file()]
        return {"bytes": sum(p.stat().st_size for p in files), "gzip_bytes": len(buffer.getvalue())}
    data = path.read_bytes()
    return {"bytes": len(data), "gzip_bytes": len(gzip.compress(data))}


@dataclass
class Tally:
    """One predictor's running figures over a split: examples, correct predictions, and (against a
    reference's logits) agreements and the largest logit difference."""

    examples: int = 0
    correct: int = 0
    agreeing: int = 0
    max_difference: float = 0.0

    def add(self, logits: np.ndarray, labels: np.ndarray, reference: np.ndarray | None = None) -> None:
        predicted = np.argmax(logits, axis=1)
        self.examples += len(labels)
        self.correct += int(np.sum(predicted == labels))
        if reference is not None:
            self.agreeing += int(np.sum(predicted == np.argmax(reference, axis=1)))
            self.max_difference = max(self.max_difference, float(np.max(np.abs(logits - reference))))

    @property
    def accuracy(self) -> float:
        return self.correct / self.examples

    def against_float(self) -> dict[str, float]:
        return {
            "test_accuracy": self.accuracy,
            "agreement_with_float": self.agreeing / self.examples,
            "max_logit_difference": self.max_difference,
        }


def streamed_accuracy(predict: Predict, batches: Iterable[tuple[np.ndarray, np.ndarray]]) -> float:
    """The accuracy of ``predict`` over ``batches`` (``hetflow.data.pipeline.split_batches``)."""
    tally = Tally()
    for images, labels in batches:
        tally.add(predict(images), labels)
    return tally.accuracy


def score_split(
    predictors: dict[str, Predict],
    reference: Predict,
    batches: Iterable[tuple[np.ndarray, np.ndarray]],
    parity: dict[str, Predict] | None = None,
) -> tuple[float, dict[str, dict[str, float]], dict[str, float]]:
    """Every predictor against ``reference`` (the float model) on the same batches, one batch held
    at a time. Returns the reference's accuracy, each predictor's ``Tally.against_float`` figures,
    and for each predictor named in ``parity`` its largest logit difference to the model given there."""
    parity = parity or {}
    float_tally, tallies = Tally(), {name: Tally() for name in predictors}
    to_model = {name: Tally() for name in parity}
    for images, labels in batches:
        reference_logits = reference(images)
        float_tally.add(reference_logits, labels)
        for name, predict in predictors.items():
            logits = predict(images)
            tallies[name].add(logits, labels, reference_logits)
            if name in parity:
                to_model[name].add(logits, labels, parity[name](images))
    scores = {name: tally.against_float() for name, tally in tallies.items()}
    return float_tally.accuracy, scores, {name: tally.max_difference for name, tally in to_model.items()}


def score(predict: Predict, images: np.ndarray, labels: np.ndarray, float_logits: np.ndarray) -> dict[str, float]:
    """``predict`` scored on arrays already in memory (the benches' and tests' samples)."""
    tally = Tally()
    tally.add(predict(images), labels, float_logits)
    return {**tally.against_float(), "latency_ms": latency_ms(predict, images)}


def judge(artifacts: dict[str, dict[str, Any]], float_accuracy: float, max_accuracy_drop: float) -> str | None:
    """Check parity of the float artifacts (the pruned one against the pruned model), accept or
    reject each by its accuracy drop, and pick the TFLite variant to deploy: the smallest accepted
    file, in bytes on disk (None if none is accepted)."""
    for name, artifact in artifacts.items():
        is_float = artifact["format"] == "saved_model" or artifact.get("variant") == "float"
        if is_float and artifact["max_logit_difference"] > PARITY_TOLERANCE:
            raise ParityError(
                f"{name} does not reproduce the float model: logits differ by up to "
                f"{artifact['max_logit_difference']:.2e} (> {PARITY_TOLERANCE}) on the test split"
            )
        if artifact.get("variant") == "pruned" and artifact["max_logit_difference_to_pruned"] > PARITY_TOLERANCE:
            raise ParityError(
                f"{name} does not reproduce the pruned model: logits differ by up to "
                f"{artifact['max_logit_difference_to_pruned']:.2e} (> {PARITY_TOLERANCE}) on the test split"
            )
        drop = float_accuracy - artifact["test_accuracy"]
        artifact["accuracy_drop"] = drop
        artifact["accepted"] = drop <= max_accuracy_drop
        if not artifact["accepted"]:
            artifact["reason"] = f"accuracy drop {drop:.4f} > max_accuracy_drop {max_accuracy_drop}"
    deployable = [n for n, a in artifacts.items() if a["format"] == "tflite" and a["accepted"]]
    return min(deployable, key=lambda n: artifacts[n]["bytes"]) if deployable else None

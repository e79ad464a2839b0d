"""An exported artifact scored as export judges it: accuracy, agreement and largest logit difference
with the float model, latency per example at batch 1, size raw and gzipped; parity of the float
artifacts and the accept-or-reject of each variant by its accuracy drop (``judge``)."""

from __future__ import annotations

import gzip
import io
import tarfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

LATENCY_EXAMPLES = 200
# Float artifacts compute what the float model computes, up to float rounding.
PARITY_TOLERANCE = 1e-3


class ParityError(RuntimeError):
    pass


def latency_ms(predict: Callable[[np.ndarray], np.ndarray], images: np.ndarray) -> float:
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


def score(
    predict: Callable[[np.ndarray], np.ndarray], images: np.ndarray, labels: np.ndarray, float_logits: np.ndarray
) -> dict[str, float]:
    logits = predict(images)
    predicted = np.argmax(logits, axis=1)
    return {
        "test_accuracy": float(np.mean(predicted == labels)),
        "agreement_with_float": float(np.mean(predicted == np.argmax(float_logits, axis=1))),
        "max_logit_difference": float(np.max(np.abs(logits - float_logits))),
        "latency_ms": latency_ms(predict, images),
    }


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

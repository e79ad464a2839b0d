"""A TFLite file's LiteRT latency as a phone would see it: one example per ``invoke``, with 1 and 2
threads, ``TIMED_INVOKES`` timed after ``WARMUP_INVOKES`` (the first invokes allocate and pack weights),
summarized as p50 and p95 in milliseconds. Bounded: 2 x 220 invokes of the file, whatever its size."""

from __future__ import annotations

import re
import time

import numpy as np
from ai_edge_litert.interpreter import Interpreter

from hetflow.records import LatencyFigures, LiteRTLatency

THREADS = (1, 2)
WARMUP_INVOKES, TIMED_INVOKES = 20, 200


def litert_latency(model_file: bytes, example: np.ndarray) -> LiteRTLatency:
    """``model_file``'s invoke time on ``example`` (one input, without its batch dimension)."""
    started = time.perf_counter()
    figures = {}
    for threads in THREADS:
        interpreter = Interpreter(model_content=model_file, num_threads=threads)
        interpreter.allocate_tensors()
        interpreter.set_tensor(interpreter.get_input_details()[0]["index"], example[np.newaxis])
        for _ in range(WARMUP_INVOKES):
            interpreter.invoke()
        seconds = np.empty(TIMED_INVOKES)
        for index in range(TIMED_INVOKES):
            before = time.perf_counter()
            interpreter.invoke()
            seconds[index] = time.perf_counter() - before
        p50, p95 = np.percentile(seconds * 1000.0, [50, 95])
        figures[threads] = LatencyFigures(p50_ms=float(p50), p95_ms=float(p95))
    return LiteRTLatency(invokes=TIMED_INVOKES, threads=figures, seconds=time.perf_counter() - started)


def latency_line(latency: LiteRTLatency) -> str:
    """``p50 0.0012 / p95 0.0019 ms (1 thread); p50 ... (2 threads)``: the version page's tag."""
    return "; ".join(
        f"p50 {f.p50_ms:.4f} / p95 {f.p95_ms:.4f} ms ({n} thread{'s' if n > 1 else ''})"
        for n, f in sorted(latency.threads.items())
    )


_FIGURES = re.compile(r"p50 ([0-9.]+) / p95 ([0-9.]+) ms \((\d+) threads?\)")


def parse_latency_line(line: str) -> dict[str, dict[str, float]]:
    """``latency_line``'s figures back, by thread count: ``{"1": {"p50_ms": .., "p95_ms": ..}, ...}``."""
    return {threads: {"p50_ms": float(p50), "p95_ms": float(p95)} for p50, p95, threads in _FIGURES.findall(line)}

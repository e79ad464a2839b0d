"""Where a stage's wall time goes: MLflow I/O, and the rest, its own work.

A stage runs under ``stage_clock()``; code inside it marks MLflow calls with ``part("mlflow_io")``
(or wraps a client in ``TimedClient``). Parts are exclusive: a part inside another counts once, as
the inner one; so the parts add up to the stage's wall time, ``work`` being what is left. Plain
timers: nothing is patched. Only the stage's own thread is timed (the clock is a context variable,
which a new thread does not see): what helper threads do (the served checks' model servers)
overlaps with it and shows as the stage's waiting, in ``work``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from typing import Any, Iterator

# The parts of a stage's wall time, as its receipt records them: MLflow I/O; waiting on model
# servers (register's served checks, a champion scored on other data); fine-tuning (compress's
# pruning and quantization-aware training); TFLite conversion; ``work``, the rest.
PARTS = ("mlflow_io", "serving", "fine_tuning", "tflite_conversion", "work")

_current: contextvars.ContextVar[StageClock | None] = contextvars.ContextVar("stage_clock", default=None)


class StageClock:
    """Exclusive seconds per part of one stage, on the thread that started it."""

    def __init__(self) -> None:
        self.started_at = time.time()
        self._started = time.perf_counter()
        self.seconds = {part: 0.0 for part in PARTS if part != "work"}
        self._open: list[list[Any]] = []  # [part, since]: the innermost part is the one counting

    def enter(self, part: str) -> None:
        now = time.perf_counter()
        if self._open:
            outer = self._open[-1]
            self.seconds[outer[0]] += now - outer[1]
        self._open.append([part, now])

    def leave(self) -> None:
        now = time.perf_counter()
        part, since = self._open.pop()
        self.seconds[part] += now - since
        if self._open:
            self._open[-1][1] = now  # the outer part counts again from here

    def record(self) -> dict[str, float]:
        """The stage's wall time so far and its parts, in seconds."""
        wall = time.perf_counter() - self._started
        return {"wall": wall, **self.seconds, "work": wall - sum(self.seconds.values())}


@contextlib.contextmanager
def stage_clock() -> Iterator[StageClock]:
    """Time the stage this thread runs from here to the end of the block."""
    clock = StageClock()
    token = _current.set(clock)
    try:
        yield clock
    finally:
        _current.reset(token)


def current() -> StageClock | None:
    return _current.get()


@contextlib.contextmanager
def part(name: str) -> Iterator[None]:
    """Count what runs inside as ``name`` of this thread's stage (nothing when no stage is timed)."""
    clock = current()
    if clock is None:
        yield
        return
    clock.enter(name)
    try:
        yield
    finally:
        clock.leave()


class TimedClient:
    """An ``MlflowClient`` (or any object) whose every method call counts as ``mlflow_io``."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        @functools.wraps(attribute)
        def timed(*args, **kwargs):
            with part("mlflow_io"):
                return attribute(*args, **kwargs)

        return timed

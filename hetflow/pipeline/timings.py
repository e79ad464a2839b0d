"""Where a stage's wall time goes: Python imports, MLflow I/O, and the rest, its own work.

A stage runs under ``stage_clock()``; code inside it marks MLflow calls with ``part("mlflow_io")``
(or wraps a client in ``TimedClient``), and every import the stage's thread makes counts as
``imports`` (measured by wrapping ``__import__`` and ``importlib.import_module`` while a clock
runs). Parts are exclusive: an import inside an MLflow call counts as imports, not twice; so the
parts add up to the stage's wall time, ``work`` being what is left. Only the stage's own thread is
timed: what helper threads do (the served checks' model servers) overlaps with it and shows as
the stage's waiting, in ``work``.

In one process (``hetflow run``'s ``dag.test``) a module is imported once, by the first stage that
needs it; a stage that runs in a process of its own (a scheduler's worker) imports what it uses.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib
import threading
import time
from typing import Any, Iterator

# The parts of a stage's wall time, as its receipt records them (``work``: the rest).
PARTS = ("imports", "mlflow_io", "work")

_clocks = threading.local()  # the clock of the stage this thread runs, if any
_hooks_lock = threading.Lock()
_running_clocks = 0
_original_import = builtins.__import__
_original_import_module = importlib.import_module


class StageClock:
    """Exclusive seconds per part of one stage, on the thread that started it."""

    def __init__(self) -> None:
        self.started_at = time.time()
        self._started = time.perf_counter()
        self.seconds = {"imports": 0.0, "mlflow_io": 0.0}
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


def _timed_import(*args, **kwargs):
    clock = getattr(_clocks, "current", None)
    if clock is None:
        return _original_import(*args, **kwargs)
    clock.enter("imports")
    try:
        return _original_import(*args, **kwargs)
    finally:
        clock.leave()


@functools.wraps(_original_import_module)
def _timed_import_module(name, package=None):
    clock = getattr(_clocks, "current", None)
    if clock is None:
        return _original_import_module(name, package)
    clock.enter("imports")
    try:
        return _original_import_module(name, package)
    finally:
        clock.leave()


@contextlib.contextmanager
def stage_clock() -> Iterator[StageClock]:
    """Time the stage this thread runs from here; the import hooks are in place while any clock runs."""
    global _running_clocks
    clock = StageClock()
    with _hooks_lock:
        if _running_clocks == 0:
            builtins.__import__ = _timed_import
            importlib.import_module = _timed_import_module
        _running_clocks += 1
    outer, _clocks.current = getattr(_clocks, "current", None), clock
    try:
        yield clock
    finally:
        _clocks.current = outer
        with _hooks_lock:
            _running_clocks -= 1
            if _running_clocks == 0:
                builtins.__import__ = _original_import
                importlib.import_module = _original_import_module


def current() -> StageClock | None:
    return getattr(_clocks, "current", None)


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

"""Training as it happens, seen from the pipeline: the epochs the chief reports
(``replica_output/progress.jsonl``, one JSON line an epoch) and each replica's CPU and memory, handed
every few seconds to whoever watches (the live MLflow run, a tuning study's pruner).

A replica writes the progress file: it is read as hostile data, through ``read_regular`` (no link
followed, a regular file, bounded), each line checked against the spec before anyone sees it. A
replica that floods the file is read no further; one that lies gets its lines dropped, one warning."""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable

from hetflow.paths import NotRegularFile, RunPaths, read_regular
from hetflow.spec import RunSpec

log = logging.getLogger("hetflow.stages")

# 1000 epochs (the spec's most) of a few hundred bytes each, with room for many workers.
PROGRESS_BYTES = 1 << 20
FIGURES = (
    "loss",
    "accuracy",
    "val_loss",
    "val_accuracy",
    "learning_rate",
    "epoch_seconds",
    "examples_per_second",
    "staleness_mean",
    "staleness_max",
)
WATCH_SECONDS = 2.0


class StoppedEarly(RuntimeError):
    """A watcher asked to stop training (a tuning study pruned the trial) and every replica was
    stopped: an outcome the caller asked for, not a failure."""


@dataclass(frozen=True)
class Epoch:
    """One epoch as the chief reported it, checked: ``figures`` holds those of ``FIGURES`` it gave."""

    epoch: int
    figures: dict[str, float]
    worker_examples_per_second: dict[str, float] = field(default_factory=dict)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class ProgressReader:
    """The epochs the chief has reported since the last call (whole lines only: the one being
    written has no newline yet)."""

    def __init__(self, paths: RunPaths, spec: RunSpec, workers: Iterable[str]):
        self.path, self.spec, self.workers = paths.progress, spec, set(workers)
        self._lines_taken = 0
        self._refused = False
        self._warned_bad_line = False

    def new_epochs(self) -> list[Epoch]:
        if self._refused:
            return []
        try:
            content = read_regular(self.path, PROGRESS_BYTES)
        except FileNotFoundError:
            return []
        except NotRegularFile as refused:
            self._refused = True
            log.warning("training progress is no longer read: %s", refused)
            return []
        lines = content.split(b"\n")[:-1]
        if len(lines) < self._lines_taken:  # a new attempt started the file again
            self._lines_taken = 0
        new, self._lines_taken = lines[self._lines_taken :], len(lines)
        epochs = [self._checked(line) for line in new]
        return [epoch for epoch in epochs if epoch is not None]

    def _checked(self, line: bytes) -> Epoch | None:
        try:
            value = json.loads(line)
            epoch = value["epoch"]
            valid = isinstance(epoch, int) and not isinstance(epoch, bool) and 1 <= epoch <= self.spec.training.epochs
            rates = value.get("worker_examples_per_second", {})
            valid = (
                valid and isinstance(rates, dict) and set(rates) <= self.workers and all(map(_number, rates.values()))
            )
            figures = {name: value[name] for name in FIGURES if name in value}
            valid = valid and all(map(_number, figures.values()))
        except (ValueError, TypeError, KeyError):
            valid = False
        if not valid:
            if not self._warned_bad_line:
                self._warned_bad_line = True
                log.warning("dropped a progress line the chief wrote that is not an epoch's figures: %.200r", line)
            return None
        return Epoch(epoch, {k: float(v) for k, v in figures.items()}, {k: float(v) for k, v in rates.items()})


# A watcher gets the new epochs and the replicas' usage; what it returns, if not None, is a reason to
# stop training now (a pruned trial).
Watcher = Callable[[list[Epoch], dict[str, dict[str, float]]], "str | None"]


class ProgressWatch:
    """A thread that hands ``reader``'s new epochs and ``sample()``'s usage to each watcher as the
    replicas start training, every ``interval`` seconds while they train, and once more when it
    stops. A watcher that fails is warned about once and dropped: watching never fails training."""

    def __init__(self, reader: ProgressReader, sample, watchers: list[Watcher], interval: float = WATCH_SECONDS):
        self.reader, self.sample, self.watchers, self.interval = reader, sample, list(watchers), interval
        self.stop_reason: str | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-watch", daemon=True)

    def __enter__(self) -> ProgressWatch:
        if self.watchers:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.watchers:
            self._stopping.set()
            self._thread.join()

    def _run(self) -> None:
        # A look as training starts too: a replica whose whole job is shorter than two intervals
        # (a short run's, on a quiet machine: 4.1 s measured) still gets its memory charted.
        stopping = False
        while not stopping:
            self._once()
            stopping = self._stopping.wait(self.interval)
        self._once()

    def _once(self) -> None:
        epochs = self.reader.new_epochs()
        usage = {}
        if self.sample is not None:
            try:
                usage = self.sample()
            except Exception as error:  # the engine or /proc answering badly costs the chart, not the run
                log.warning("replica usage not sampled: %s", error)
                self.sample = None
        for watcher in list(self.watchers):
            try:
                reason = watcher(epochs, usage)
            except Exception as error:
                log.warning("stopped watching training with %s: %s", getattr(watcher, "__name__", watcher), error)
                self.watchers.remove(watcher)
                continue
            if reason and self.stop_reason is None:
                self.stop_reason = reason

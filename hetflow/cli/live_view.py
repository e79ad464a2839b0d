"""What ``hetflow run`` shows while the DAG runs: a line per DAG task as it starts and ends (with
its time), the replicas as they start and stop, and a progress bar per epoch with the chief's
loss and accuracy. Everything else (Airflow's structured log, whole specs, return values, every
replica line) goes to a log file; ``hetflow run -v`` prints it all instead.

It is a logging handler reading the records the run emits anyway: Airflow's ``[DAG TEST]`` task
boundaries, the supervisor's ``started ...`` lines and the replicas' output, which the supervisor
logs as ``[worker-0] ...``.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import TextIO

_TASK_START = re.compile(r"^\[DAG TEST\] starting task_id=(\S+)")
_TASK_END = re.compile(r"^\[DAG TEST\] end task task_id=(\S+)")
_REPLICA_LINE = re.compile(r"^\[((?:worker|chief|ps)-\d+)\] (.*)$")
_STARTED = re.compile(r"^started ((?:worker|chief|ps)-\d+) \((.*)$")
_ENDED = re.compile(r"^(?:(?:worker|chief|ps)-\d+ (?:finished|exited with|killed by)|stopping )")
_EPOCH = re.compile(r"^Epoch (\d+)/(\d+)")
# Keras' and our loops' epoch summaries: "loss: 0.4123 - accuracy: 0.9121 - val_accuracy: 0.93".
_METRIC = re.compile(r"\b(loss|accuracy|val_loss|val_accuracy): ([0-9.]+(?:e-?\d+)?)")
_CHIEFS = ("chief-0", "worker-0")  # the chief of parameter_server, else worker 0
BAR_WIDTH = 20


class LiveView(logging.Handler):
    def __init__(self, out: TextIO = sys.stdout):
        super().__init__(level=logging.INFO)
        self.out = out
        self.task_started: dict[str, float] = {}
        self.task_errors: set[str] = set()
        self.current_task: str | None = None
        self.epoch: tuple[int, int] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._show(record.getMessage(), record)
        except Exception:  # the view must never break the run
            self.handleError(record)

    def _print(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _show(self, message: str, record: logging.LogRecord) -> None:
        if match := _TASK_START.match(message):
            self.current_task = match[1]
            self.task_started[match[1]] = time.monotonic()
            self._print(f"> {match[1]}")
        elif match := _TASK_END.match(message):
            task = match[1]
            seconds = time.monotonic() - self.task_started.get(task, time.monotonic())
            outcome = "failed" if task in self.task_errors else "done"
            self._print(f"  {task} {outcome} in {seconds:.1f} s")
            self.current_task = None
        elif record.levelno >= logging.ERROR and self.current_task:
            self.task_errors.add(self.current_task)
            self._print(f"  ! {message.splitlines()[0][:300]}")
        elif match := _ENDED.match(message):
            self._print(f"  - {message}")
        elif match := _STARTED.match(message):
            self._print(f"  + {match[1]} started ({match[2]}")
        elif record.name == "hetflow.auto":
            self._print(f"  auto: {message}")
        elif record.name == "hetflow.stages" and message.startswith("teardown: "):
            self._print(f"  - {message}")
        elif record.name == "hetflow.cluster" and record.levelno >= logging.WARNING:
            self._print(f"  ! {message}")
        elif match := _REPLICA_LINE.match(message):
            self._replica_line(match[1], match[2])

    def _replica_line(self, name: str, line: str) -> None:
        if name not in _CHIEFS:
            return
        if match := _EPOCH.match(line):
            self.epoch = (int(match[1]), int(match[2]))
        metrics = dict(_METRIC.findall(line))
        if self.epoch and "loss" in metrics:
            done, total = self.epoch
            filled = round(BAR_WIDTH * done / total)
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            shown = " - ".join(f"{key} {float(value):.4f}" for key, value in metrics.items())
            self._print(f"  [{name}] Epoch {done}/{total} [{bar}] {shown}")
        elif line.startswith("trained "):
            self._print(f"  [{name}] {line}")

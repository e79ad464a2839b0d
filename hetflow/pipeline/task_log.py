"""A DAG task's Airflow log: library noise kept off ERROR, and a failure's one-line headline.

Airflow 3's supervisor logs every line its task process writes to stderr at ERROR, and libraries
write there directly: TensorFlow's C++ start-up lines ("failed call to cuInit", CPU feature notes),
many of them while a stage module is imported, MLflow's own log handler ("Created version '1'"),
download and progress bars. The DAGs hook three callbacks onto every task: from
``capture_library_output`` (before the task body runs, imports included) a task process under
Airflow (its file descriptor 2 is the supervisor's socket) writes stderr to an anonymous file; when
the task ends, its lines are logged at DEBUG on ``hetflow.library`` (``log_library_output``; none of
TensorFlow's start-up notes and CUDA probing, ``hetflow.cluster.output_lines.startup_noise``), or,
when it failed, its last lines at WARNING and then one ERROR line naming the task and the cause
(``log_failure_headline``). Airflow calls the failure callback after logging the traceback, so that
line ends the failed task's log. Elsewhere (``hetflow run`` already sends stderr to its log file; a
terminal) stderr is left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from typing import Any

from hetflow.cluster.output_lines import startup_noise, stderr_captured

log = logging.getLogger("hetflow.library")

TAIL_ON_FAILURE = 20  # lines shown at WARNING when the task failed

_capture: contextlib.ExitStack | None = None  # while stderr goes to a file
_captured: list[str] = []  # what was written there, once it is given back


def _stderr_is_a_socket() -> bool:
    try:
        return stat.S_ISSOCK(os.fstat(2).st_mode)
    except OSError:
        return False


def capture_library_output(context: Any = None) -> None:
    """``on_execute_callback``: from now on stderr goes to an anonymous file, under Airflow only."""
    global _capture, _captured
    if _capture is not None or not _stderr_is_a_socket():
        return
    _capture = contextlib.ExitStack()
    _captured = _capture.enter_context(stderr_captured())


def _release() -> list[str]:
    """Give stderr back; log what was captured at DEBUG, less TensorFlow's start-up lines that say
    nothing to act on (a stage computes on whatever devices there are: its probing for CUDA on a
    machine without one is among them), and return those lines."""
    global _capture
    if _capture is None:
        return []
    _capture.close()
    _capture = None
    lines = [line for line in _captured if not startup_noise(line)]
    for line in lines:
        log.debug("%s", line)
    return lines


def log_library_output(context: Any = None) -> None:
    """``on_success_callback``: what libraries wrote to stderr, at DEBUG."""
    _release()


def failure_headline(stage: str, error: BaseException | None) -> str:
    """One line: the stage, the error's type and the first line of its message."""
    if error is None:
        return f"{stage} failed"
    message = str(error).strip().splitlines()
    return f"{stage} failed: {type(error).__name__}" + (f": {message[0]}" if message else "")


def log_failure_headline(context: dict[str, Any]) -> None:
    """``on_failure_callback``: the libraries' last words at WARNING, then the failure's headline
    as the task log's last ERROR line."""
    lines = _release()
    if lines:
        log.warning("the last lines libraries wrote to stderr before the failure:")
        for line in lines[-TAIL_ON_FAILURE:]:
            log.warning("  %s", line)
    logging.getLogger("hetflow.stages").error("%s", failure_headline(context["ti"].task_id, context.get("exception")))


# What every hetflow DAG puts in its default_args (hetflow_retrain's too).
CALLBACKS = {
    "on_execute_callback": capture_library_output,
    "on_success_callback": log_library_output,
    "on_failure_callback": log_failure_headline,
}

# What hetflow's DAGs (hetflow_train, hetflow_tune) share: they run when triggered (hetflow_retrain
# triggers hetflow_train on a schedule or on new data), unpaused, since a paused DAG's triggered run
# would wait in the queue. Task logs: what libraries write to stderr goes to DEBUG, not ERROR; a failed
# task's log ends with one ERROR line naming the task and the cause. Each stage logs what it did in a
# few lines; its return value (whole records, on one line) stays out of its log.
DAG_ARGUMENTS = {
    "schedule": None,
    "catchup": False,
    "is_paused_upon_creation": False,
    "tags": ["hetflow"],
    "default_args": {"retries": 0, **CALLBACKS, "show_return_value_in_logs": False},
}

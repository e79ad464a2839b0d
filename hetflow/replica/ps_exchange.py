"""What an asynchronous step moves between a worker and the ps, measured apart from the computation
(training.json's ``communication``).

A parameter_server step reads every variable of the model from its ps onto the worker that runs
the step, computes a gradient there and sends it back to the ps, where the optimizer applies it.
What is recorded:

- ``bytes_to_worker`` and ``bytes_to_ps``: the model's variables' sizes, what a step's reads and
  its gradients carry (the step counter's few bytes left out);
- ``seconds_per_step``: that exchange timed alone, before the first step. A function scheduled
  through the coordinator, as the training closures are, reads every variable onto the worker and
  adds to each, on its ps, an update of its size computed on the worker (the variable times a zero
  passed in, which nothing can fold away: the variables do not change), ``steps_per_closure``
  times per closure. Once every worker has run it (traced, and the function sent to it),
  ``TIMED_CLOSURES`` closures run one at a time; the median closure's time per exchange. One worker
  exchanges, nothing else runs: the cost of the transfers, the additions on the ps and the
  coordinator's share of a step, not what they cost in training, where the workers share the ps
  and the cores with their compute.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import tensorflow as tf

from hetflow.replica.record import tensor_bytes

TIMED_CLOSURES = 5


def time_exchange(
    strategy, coordinator, workers: int, variables: list[tf.Variable], steps_per_closure: int
) -> list[float]:
    """Seconds of each of ``TIMED_CLOSURES`` closures of ``steps_per_closure`` exchanges of
    ``variables`` (see the module's docstring), run one at a time after one for each of the
    ``workers``."""

    def exchange_once(zero):
        for variable in variables:
            variable.assign_add(variable.read_value() * tf.cast(zero, variable.dtype))

    @tf.function
    def exchange(zero):
        for _ in tf.range(steps_per_closure):
            strategy.run(exchange_once, args=(zero,))

    zero = tf.constant(0.0)
    for _ in range(workers):  # all at once, so each free worker takes one
        coordinator.schedule(exchange, args=(zero,))
    coordinator.join()
    seconds = []
    for _ in range(TIMED_CLOSURES):
        started = time.perf_counter()
        coordinator.schedule(exchange, args=(zero,))
        coordinator.join()
        seconds.append(time.perf_counter() - started)
    return seconds


def communication_record(
    variables: list[tf.Variable], closure_seconds: list[float], steps_per_closure: int
) -> dict[str, Any]:
    """training.json's ``communication``: the bytes a step moves and ``time_exchange``'s seconds."""
    size = tensor_bytes(variables)
    return {
        "seconds_per_step": statistics.median(closure_seconds) / steps_per_closure,
        "bytes_to_worker": size,
        "bytes_to_ps": size,
        "variables": len(variables),
        "measured": "every variable read onto one worker and an update of its size added on its ps, "
        "through the coordinator, alone, before the first step",
        "steps_per_closure": steps_per_closure,
        "closure_seconds": closure_seconds,
    }

"""balance_batches measured inside training, not in a launch of its own.

The first steps train on equal shares of the global batch, each worker timing its own gradient
computation apart from the all-reduce that applies it (with equal shares every worker's step
lasts as long as the slowest one's; its computation alone does not). After measured steps 4, 8,
16, ... the workers add up their timings in one small collective; once the fastest worker has
computed for ``MEASURE_SECONDS`` every worker takes a share proportional to its speed. Every
worker sees the same sums, so all switch at the same step, and they go on from the next global
batch: the steps taken while measuring are training steps too.

A second round measures again on the balanced shares and sets the shares the run keeps. On equal
shares the fast worker waits for the slow one half the time, and a worker limited by a CPU quota
(a container's, a Swarm node's) then computes on quota it saved while waiting: it measures faster
than it trains once nobody waits. On balanced shares every worker is busy as it will be.
"""

from __future__ import annotations

from typing import Any

WARMUP_STEPS = 2  # per round: tracing (a new share is a new shape) stays out of the measurement
MEASURE_SECONDS = 0.5  # of the fastest worker's computation: 25 periods of the throttle's stop-and-continue
FIRST_EXCHANGE = 4  # measured steps before a round's first exchange; the next ones come after twice as many
# A model whose steps take the fastest worker under 8 ms is balanced on what was measured by then
# (steps that short gain little from distributing at all: tasks.auto_strategy).
MAX_MEASURED_STEPS = 64
ROUNDS = 2


class Relaunch(Exception):
    """strategy=auto chose a layout this launch does not have: the replicas stop, ``train`` relaunches."""


class MeasuringRound:
    """One worker's part of a round: ``timed(batch, seconds)`` after each step, with its share and
    the time its gradient computation took; returns every worker's probe (as plan.json keeps
    them) once the workers have been measured long enough, and None until then."""

    def __init__(self, number: int, worker: int, workers: int, model_parameters: int, sum_over_workers):
        self.number, self.worker, self.workers = number, worker, workers
        self.model_parameters = model_parameters
        self.sum_over_workers = sum_over_workers
        self.steps_taken = 0
        self.measured_steps, self.measured_seconds, self.measured_examples = 0, 0.0, 0
        self.next_exchange = FIRST_EXCHANGE

    def timed(self, batch: int, seconds: float) -> list[dict[str, Any]] | None:
        self.steps_taken += 1
        if self.steps_taken <= WARMUP_STEPS:
            return None
        self.measured_steps += 1
        self.measured_seconds += seconds
        self.measured_examples += batch
        if self.measured_steps < self.next_exchange:
            return None
        self.next_exchange *= 2
        slots = [0.0] * (2 * self.workers)  # (seconds, examples) per worker, zeros but this worker's
        slots[2 * self.worker : 2 * self.worker + 2] = self.measured_seconds, self.measured_examples
        summed = self.sum_over_workers(slots)
        seconds_per_worker, examples_per_worker = summed[0::2], summed[1::2]
        if min(seconds_per_worker) < MEASURE_SECONDS and self.measured_steps < MAX_MEASURED_STEPS:
            return None
        return [
            {
                "worker": f"worker-{i}",
                "batch": round(examples / self.measured_steps),
                "steps": self.measured_steps,
                "examples_per_second": examples / seconds,
                "step_seconds": seconds / self.measured_steps,
                "model_parameters": self.model_parameters,
                "measured": f"round {self.number}: {self.measured_steps} steps, computation only",
            }
            for i, (seconds, examples) in enumerate(zip(seconds_per_worker, examples_per_worker))
        ]

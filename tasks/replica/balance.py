"""balance_batches measured inside training, not in a launch of its own.

The first steps train on equal shares of the global batch, each worker timing its own gradient
computation apart from the all-reduce that applies it (with equal shares every worker's step
lasts as long as the slowest one's; its computation alone does not). After measured steps 4, 8,
16, ... the workers add up their timings in one small collective; once the fastest worker has
computed for ``MEASURE_SECONDS`` every worker takes a share proportional to its speed. Every
worker sees the same sums, so all switch at the same step, and they go on from the next global
batch: the steps taken while measuring were training steps too.
"""

from __future__ import annotations

from typing import Any

WARMUP_STEPS = 2  # tracing and first-touch costs stay out of the measurement
MEASURE_SECONDS = 0.5  # of the fastest worker's computation: 25 periods of the throttle's stop-and-continue
FIRST_EXCHANGE = 4  # measured steps before the first exchange; the next ones come after twice as many
# A model whose steps take the fastest worker under 8 ms is balanced on what was measured by then
# (steps that short gain little from distributing at all: tasks.auto_strategy).
MAX_MEASURED_STEPS = 64


class InTrainingProbe:
    """One worker's measurement: ``timed(seconds)`` after each step with this worker's gradient
    computation time; it returns every worker's probe (``tasks.replica.probe``'s fields) once
    the workers have been measured long enough, and None until then."""

    def __init__(self, worker: int, workers: int, batch: int, model_parameters: int, sum_over_workers):
        self.worker, self.workers, self.batch = worker, workers, batch
        self.model_parameters = model_parameters
        self.sum_over_workers = sum_over_workers
        self.steps_taken = 0
        self.measured_steps, self.measured_seconds = 0, 0.0
        self.next_exchange = FIRST_EXCHANGE

    def timed(self, seconds: float) -> list[dict[str, Any]] | None:
        self.steps_taken += 1
        if self.steps_taken <= WARMUP_STEPS:
            return None
        self.measured_steps += 1
        self.measured_seconds += seconds
        if self.measured_steps < self.next_exchange:
            return None
        self.next_exchange *= 2
        slots = [0.0] * self.workers
        slots[self.worker] = self.measured_seconds
        seconds_per_worker = self.sum_over_workers(slots)
        if min(seconds_per_worker) < MEASURE_SECONDS and self.measured_steps < MAX_MEASURED_STEPS:
            return None
        return [
            {
                "worker": f"worker-{i}",
                "batch": self.batch,
                "steps": self.measured_steps,
                "examples_per_second": self.batch * self.measured_steps / seconds,
                "step_seconds": seconds / self.measured_steps,
                "model_parameters": self.model_parameters,
                "measured": f"in training, steps {WARMUP_STEPS + 1}-{self.steps_taken}, computation only",
            }
            for i, seconds in enumerate(seconds_per_worker)
        ]

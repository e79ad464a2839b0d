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

import json
from typing import Any

from tasks.auto_strategy import decide
from tasks.batch_shares import split_batch
from tasks.paths import RunPaths, write_record
from tasks.spec import RunSpec, parse_spec

WARMUP_STEPS = 2  # per round: tracing, first touches and a new input's first batches stay out of it
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


class WorkerShares:
    """Every worker's share of the global batch over one replica's training (``now``): fixed where
    it is known (equal without ``balance_batches``; plan.json's, written by an earlier launch of
    this group), else measured in rounds as the module says and then kept. With strategy=auto
    (requested_spec.json) the last round's probes go to its policy: equal or balanced shares, or
    ``Relaunch``. The chief records what was measured and decided in plan.json."""

    def __init__(
        self,
        spec: RunSpec,
        paths: RunPaths,
        task: dict[str, Any],
        is_chief: bool,
        model_parameters: int,
        sum_over_workers,
    ):
        self.spec, self.paths, self.worker, self.is_chief = spec, paths, task["index"], is_chief
        self.workers = spec.workers if spec.strategy == "multi_worker_mirrored" else 1
        self.model_parameters, self.sum_over_workers = model_parameters, sum_over_workers
        self.equal = split_batch(spec.batch_size, [1.0] * self.workers)
        plan = json.loads(paths.plan.read_text()) if spec.balance_batches and paths.plan.exists() else {}
        self.now: list[int] = plan.get("worker_batches") or self.equal
        self.round = None
        if spec.balance_batches and self.workers > 1 and "worker_batches" not in plan:
            self.round = MeasuringRound(1, self.worker, self.workers, model_parameters, sum_over_workers)
        self.first_round: list[dict[str, Any]] = []

    @property
    def measuring(self) -> bool:
        return self.round is not None

    @property
    def balanced(self) -> bool:
        """Whether the shares are not all equal (never while measuring, which starts on equal ones)."""
        return self.now != self.equal

    def measured_step(self, computed_seconds: float) -> bool:
        """Count a step whose gradient computation took ``computed_seconds`` here; True where the
        shares changed with it (the input must follow)."""
        probes = self.round.timed(self.now[self.worker], computed_seconds)
        if not probes:
            return False
        mine = probes[self.worker]
        print(
            f"probe worker-{self.worker}: {mine['examples_per_second']:.0f} examples/s "
            f"({1000 * mine['step_seconds']:.1f} ms of computation per step of {mine['batch']}, {mine['measured']})",
            flush=True,
        )
        if self.round.number < ROUNDS:
            self.first_round = probes
            self.now = split_batch(self.spec.batch_size, [p["examples_per_second"] for p in probes])
            self.round = MeasuringRound(
                self.round.number + 1, self.worker, self.workers, self.model_parameters, self.sum_over_workers
            )
            print(f"measuring again on batches {self.now} of {self.spec.batch_size}", flush=True)
        else:
            self.now = self._kept(probes)
            self.round = None
            self.announce()
        return True

    def _kept(self, probes: list[dict[str, Any]]) -> list[int]:
        requested = json.loads(self.paths.requested_spec.read_text()) if self.paths.requested_spec.exists() else None
        plan = {"requested": requested or self.spec.model_dump(mode="json"), "first_round": self.first_round}
        plan["probes"] = probes
        balance = True
        if requested is not None:
            plan["decision"] = decide(parse_spec(requested), probes)
            print(plan["decision"]["reason"], flush=True)
            if plan["decision"]["strategy"] != "multi_worker_mirrored":
                self._record(plan)
                raise Relaunch(plan["decision"]["reason"])
            balance = plan["decision"]["settings"]["balance_batches"]
        speeds = [p["examples_per_second"] for p in probes] if balance else [1.0] * self.workers
        plan["worker_batches"] = split_batch(self.spec.batch_size, speeds)
        self._record(plan)
        return plan["worker_batches"]

    def _record(self, plan: dict[str, Any]) -> None:
        if self.is_chief:
            write_record(self.paths.plan, plan)

    def announce(self) -> None:
        if self.measuring:
            print(f"equal batches {self.now} of {self.spec.batch_size} while measuring each worker's speed", flush=True)
        else:
            kind = "balanced" if self.balanced else "equal"
            print(
                f"{kind} batches {self.now} of {self.spec.batch_size}; this worker takes {self.now[self.worker]}",
                flush=True,
            )

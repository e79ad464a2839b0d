"""balance_batches and strategy=auto: the workers measured by the training replicas themselves, in
the seconds before their first step. balance_batches then trains in the same launch; strategy=auto's
launch only measures, and provisioning decides from the probes (``hetflow.tasks.provision_cluster``).

Once the strategy has connected the workers and traced the step, every worker computes gradients
on batches of an equal share, without applying them and without any collective, for
``MEASURE_SECONDS``; a collective starts them together, so they share the machine as they will
while training, and another adds up what each computed. Computing without a pause is what makes
the measure honest: a worker limited by a CPU quota (a container's, a Swarm node's) or stopped by
the throttle for part of each period computes on quota it saved whenever it waits, so timing the
computation of training steps, where the fast worker waits for the slow one, makes a half-quota
container look well over 2x slower than its peer.

The measuring batches come from an iterator of their own: training starts at the stream's first
global batch, on the shares measured.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from hetflow.paths import NotRegularFile, RunPaths
from hetflow.records import PlanFile
from hetflow.replica.auto_strategy import AutoDecision, Probe, checked_probes, decide
from hetflow.replica.batch_shares import split_batch
from hetflow.spec import RunSpec

WARMUP_STEPS = 2  # tracing and first touches stay out of the measurement
# 100 periods of the throttle's stop-and-continue, 20 of the kernel's CPU quota
MEASURE_SECONDS = 2.0


class Probed(Exception):
    """A launch of ``strategy=auto``'s has measured its workers: they stop, and provisioning decides."""


def measure_workers(
    compute, batches, batch: int, worker: int, workers: int, model_parameters: int, sum_over_workers
) -> list[Probe]:
    """Every worker's probe (as plan.json keeps them): ``compute(images, labels)`` run on ``batches``
    of ``batch`` examples without a pause for ``MEASURE_SECONDS``, all workers at once."""
    for _ in range(WARMUP_STEPS):
        compute(*next(batches))
    sum_over_workers([0.0])  # every worker starts measuring at the same moment
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < MEASURE_SECONDS:
        compute(*next(batches))
        steps += 1
    seconds = time.perf_counter() - started
    slots = [0.0] * (2 * workers)  # (seconds, steps) per worker, zeros but this worker's
    slots[2 * worker : 2 * worker + 2] = seconds, steps
    summed = sum_over_workers(slots)
    return [
        Probe(
            worker=f"worker-{i}",
            batch=batch,
            steps=int(steps_i),
            examples_per_second=batch * steps_i / seconds_i,
            step_seconds=seconds_i / steps_i,
            model_parameters=model_parameters,
        )
        for i, (seconds_i, steps_i) in enumerate(zip(summed[0::2], summed[1::2]))
    ]


class WorkerShares:
    """Every worker's share of the global batch for one replica's training (``now``): equal without
    ``balance_batches``; plan.json's, where an earlier launch of this group measured them; else to
    be ``measure``d before the first step. Under strategy=auto the workers only measure: the chief
    records the probes in plan.json, and every worker stops (``Probed``)."""

    def __init__(self, spec: RunSpec, paths: RunPaths, worker: int, is_chief: bool):
        self.spec, self.paths, self.worker, self.is_chief = spec, paths, worker, is_chief
        self.probing = spec.cluster.strategy == "auto"  # launched as multi_worker_mirrored (make_strategy)
        all_reduced = spec.cluster.strategy in ("multi_worker_mirrored", "auto")
        self.workers = spec.cluster.worker.replicas if all_reduced else 1  # workers in sync
        self.equal = split_batch(spec.training.batch_size, [1.0] * self.workers)
        balanced = spec.cluster.worker.balance_batches and not self.probing
        plan = PlanFile.read(paths.plan) if balanced and paths.plan.exists() else PlanFile()
        self.now: list[int] = plan.worker_batches or self.equal
        wanted = spec.cluster.worker.balance_batches or self.probing
        self.to_measure = wanted and self.workers > 1 and plan.worker_batches is None

    @property
    def balanced(self) -> bool:
        """Whether the shares are not all equal."""
        return self.now != self.equal

    def measure(self, compute, batches, model_parameters: int, sum_over_workers) -> None:
        """Measure the workers (``measure_workers``) and keep the shares that follow: proportional to
        each worker's speed, which balanced sync, if auto decides on it, starts from."""
        probes = measure_workers(
            compute, batches, self.equal[self.worker], self.worker, self.workers, model_parameters, sum_over_workers
        )
        mine = probes[self.worker]
        print(
            f"probe worker-{self.worker}: {mine.examples_per_second:.0f} examples/s "
            f"({1000 * mine.step_seconds:.1f} ms per step of {mine.batch}, {mine.steps} steps)",
            flush=True,
        )
        self.now = split_batch(self.spec.training.batch_size, [p.examples_per_second for p in probes])
        self.to_measure = False
        self._record(
            PlanFile(
                requested=self.spec.flat(mode="json"), probes=[p.model_dump() for p in probes], worker_batches=self.now
            )
        )
        if self.probing:
            raise Probed(f"worker-{self.worker} measured")

    def _record(self, plan: PlanFile) -> None:
        if self.is_chief:
            plan.write(self.paths.plan)

    def announce(self) -> None:
        kind = "balanced" if self.balanced else "equal"
        print(
            f"{kind} batches {self.now} of {self.spec.training.batch_size}; this worker takes {self.now[self.worker]}",
            flush=True,
        )


@dataclass(frozen=True)
class Measured:
    """What the pipeline takes of plan.json where the workers were probed (``measured``)."""

    requested: RunSpec  # the pipeline's own request, not the replica's copy
    probes: list[Probe]
    decision: AutoDecision | None  # strategy=auto's, made again by the pipeline
    worker_batches: list[int] | None  # each worker's share of the global batch, where they were balanced


def measured(paths: RunPaths, spec: RunSpec) -> Measured | None:
    """What the pipeline takes of plan.json, which the chief replica writes (None where no worker was
    probed): the probes and the shares, checked; the request is the pipeline's own (requested_spec.json,
    in a folder replicas see read-only, else ``spec``) and auto's decision is made again from it by the
    pipeline's code. A plan that is not what the chief writes raises NotRegularFile, one line."""
    plan = PlanFile.read(paths.plan) if os.path.lexists(paths.plan) else PlanFile()
    if plan.probes is None:
        return None
    requested = RunSpec.from_json(paths.requested_spec.read_text()) if paths.requested_spec.exists() else None
    asked = requested or spec
    probes = checked_probes(plan.probes, asked.cluster.worker.replicas, paths.plan)
    shares = plan.worker_batches
    if shares is not None and not (
        isinstance(shares, list)
        and len(shares) == len(probes)
        and all(isinstance(share, int) and not isinstance(share, bool) and share >= 0 for share in shares)
        and sum(shares) == asked.training.batch_size
    ):
        raise NotRegularFile(
            f"{paths.plan}: worker_batches must be {len(probes)} whole shares of {asked.training.batch_size}: refused"
        )
    return Measured(asked, probes, decide(requested, probes) if requested is not None else None, shares)

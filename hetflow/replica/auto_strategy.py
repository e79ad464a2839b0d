"""``strategy=auto``'s policy: from the workers' measured speeds, the choice between one device,
sync, balanced sync and async, and the sentence saying why.

The advice this encodes: synchronous training when workers are about equally fast,
since every step waits for the slowest; with unequal workers either give each a share of the
batch proportional to its speed (balanced sync: nobody waits, the update stays exact) or let each
apply its own updates (async). And do not distribute at all when a step is so short that
all-reduce would cost more than it saves.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from hetflow.paths import NotRegularFile
from hetflow.replica.batch_shares import split_batch
from hetflow.spec import RunSpec

# A step shorter than this on the fastest worker is dominated by all-reduce on CPU replicas
# (two gRPC workers run a small MLP slower than one).
MIN_STEP_SECONDS_TO_DISTRIBUTE = 0.020
# Speed spread (fastest / slowest) up to which workers count as even.
EVEN_SPREAD = 1.2
# Beyond this spread the slowest worker's share of a balanced batch gets too small to use its
# device well: async lets it work on full batches of its own.
ASYNC_SPREAD = 4.0


class Probe(BaseModel):
    """One worker's measurement before its first step (``hetflow.replica.balance.measure_workers``),
    as plan.json keeps it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    worker: str  # worker-<index>
    batch: int  # examples per measured step
    steps: int
    examples_per_second: float
    step_seconds: float
    model_parameters: int


class AutoDecision(BaseModel):
    """What ``strategy=auto`` chose: the strategy, the spec keys that carry it out, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: str
    settings: dict[str, Any]  # spec keys over the requested spec's
    reason: str


# What decide reads of a probe: a positive number of each (plan.json comes from a replica).
_PROBE_NUMBERS = {
    "examples_per_second": float,
    "step_seconds": float,
    "model_parameters": int,
    "batch": int,
    "steps": int,
}


def checked_probes(probes: Any, workers: int, record: Path) -> list[Probe]:
    """``probes`` as ``measure_workers`` writes them, one per worker in order, each field a positive
    finite number, and nothing else kept: else NotRegularFile, one line naming the field."""
    if not isinstance(probes, list) or len(probes) != workers:
        raise NotRegularFile(f"{record}: probes must be a list of {workers} probes, one per worker: refused")
    checked = []
    for i, probe in enumerate(probes):
        if not isinstance(probe, dict) or probe.get("worker") != f"worker-{i}":
            raise NotRegularFile(f"{record}: probes[{i}] must be worker-{i}'s probe (an object): refused")
        for key, kind in _PROBE_NUMBERS.items():
            value = probe.get(key)
            allowed = (int, float) if kind is float else int
            if isinstance(value, bool) or not isinstance(value, allowed) or not 0 < value < math.inf:
                raise NotRegularFile(
                    f"{record}: probes[{i}].{key} must be a positive {'number' if kind is float else 'integer'}, "
                    f"not {value!r:.40}: refused"
                )
        checked.append(Probe(worker=f"worker-{i}", **{key: probe[key] for key in _PROBE_NUMBERS}))
    return checked


def decide(spec: RunSpec, probes: list[Probe]) -> AutoDecision:
    """The strategy for ``spec`` given the probes: the settings to apply and a sentence saying why."""
    speeds = [p.examples_per_second for p in probes]
    fastest = max(range(len(speeds)), key=lambda i: speeds[i])
    spread = max(speeds) / min(speeds)
    step = probes[fastest].step_seconds
    measured = (
        f"measured {', '.join(f'{s:.0f}' for s in speeds)} examples/s (spread {spread:.2f}x), "
        f"{1000 * step:.1f} ms per step on the fastest worker for a {probes[0].model_parameters:,}-parameter model"
    )
    if spec.cluster.worker.replicas == 1 or step < MIN_STEP_SECONDS_TO_DISTRIBUTE:
        why = (
            "one worker"
            if spec.cluster.worker.replicas == 1
            else f"steps under {1000 * MIN_STEP_SECONDS_TO_DISTRIBUTE:.0f} ms"
        )
        device = spec.cluster.worker_device(fastest)
        return AutoDecision(
            strategy="one_device",
            settings={"strategy": "one_device", "workers": 1, "ps": 0, "worker_devices": [device.model_dump()]},
            reason=f"auto chose one_device on worker-{fastest}: {measured}; {why} would spend more time in "
            "all-reduce than a second worker saves",
        )
    if spread <= EVEN_SPREAD and spec.training.batch_size % spec.cluster.worker.replicas == 0:
        return AutoDecision(
            strategy="multi_worker_mirrored",
            settings={"strategy": "multi_worker_mirrored", "ps": 0, "balance_batches": False},
            reason=f"auto chose sync all-reduce (multi_worker_mirrored): {measured}; the workers are even "
            f"(spread <= {EVEN_SPREAD}), so equal batches make no one wait",
        )
    shares = split_batch(spec.training.batch_size, speeds)
    if spread <= ASYNC_SPREAD:
        return AutoDecision(
            strategy="multi_worker_mirrored",
            settings={"strategy": "multi_worker_mirrored", "ps": 0, "balance_batches": True},
            reason=f"auto chose balanced sync: {measured}; per-worker batches {'/'.join(map(str, shares))} "
            f"(global {spec.training.batch_size}) let every worker finish a step at the same time, with the exact "
            "global-batch update",
        )
    per_worker = max(1, spec.training.batch_size // spec.cluster.worker.replicas)
    return AutoDecision(
        strategy="parameter_server",
        settings={"strategy": "parameter_server", "ps": max(spec.cluster.ps.replicas, 1), "batch_size": per_worker},
        reason=f"auto chose async (parameter_server): {measured}; beyond a {ASYNC_SPREAD}x spread the slowest "
        f"worker's balanced share would be {min(shares)} examples, so each worker applies its own batches of "
        f"{per_worker} instead",
    )

"""Where model_parallel cuts the model: consecutive layer groups, one per stage, chosen by parameter
count or by measured time. No TensorFlow: the pipeline recomputes a replica's split with it.

The measured split is held to the model's state first: every stage holds some of the variables
(a stage of weightless layers holds none of what model parallelism exists to spread), and, across
workers with ``replica_memory_mb``, no stage more variables, gradients and optimizer slots than its
replica holds beside TensorFlow's own (``StateLimits``). Among the cuts that allows, it balances time:
a pipelined step runs at the pace of its slowest stage (``pipelined_step_seconds``), so the
measured split minimises the largest stage time: its layers' measured seconds (forward and backward
of one micro-batch), scaled by its device's speed against the device they were measured on, plus
what crosses the cut before it (the activations forward, their gradients back, at the measured
seconds per byte), solved exactly as a contiguous partition by dynamic programming over layer
boundaries.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError

from hetflow.paths import NotRegularFile
from hetflow.records import PlanFile, refused
from hetflow.replica.training_json import (
    MAX_LAYERS,
    MAX_SECONDS,
    MAX_WORKERS,
    Count,
    Name,
    Seconds,
    Strict,
    TrainingRecord,
)
from hetflow.spec import RunSpec


def split_by_parameters(counts: list[int], parts: int) -> list[int]:
    """Group boundaries for consecutive items so each group holds about 1/parts of the total;
    returns the start index of each group after the first. Every group gets at least one item."""
    total = sum(counts) or 1
    bounds, running = [], 0
    for index, count in enumerate(counts[:-1]):
        running += count
        remaining_items, remaining_groups = len(counts) - index - 1, parts - 1 - len(bounds)
        due = running >= total * (len(bounds) + 1) / parts
        if remaining_groups and (due or remaining_items == remaining_groups):
            bounds.append(index + 1)
    return bounds


@dataclass(frozen=True)
class StageCosts:
    """What a stage's time is predicted from: each layer's measured seconds (forward and backward of
    one micro-batch, on the first stage's device), each stage device's seconds for a fixed piece of
    work (its speed), each layer's output bytes for one micro-batch, and the seconds per byte that
    moving a tensor from each stage's device to the next took."""

    layer_seconds: list[float]
    stage_work_seconds: list[float]
    cut_bytes: list[int]
    transfer_seconds_per_byte: list[float]

    @cached_property
    def _seconds_before(self) -> list[float]:
        """The layers' seconds summed up to each layer: the split's dynamic program asks for a
        group's seconds once per (stage, start, end), which a sum of the slice would make cubic."""
        return [0.0, *itertools.accumulate(self.layer_seconds)]

    def stage(self, stage: int, start: int, end: int) -> float:
        """Stage ``stage`` holding layers ``start``..``end - 1``: their seconds on its device (scaled
        from the first stage's by the two devices' speeds), and, after the first stage, its input
        arriving and its gradient going back across the cut."""
        seconds = self._seconds_before[end] - self._seconds_before[start]
        compute = seconds * self.stage_work_seconds[stage] / self.stage_work_seconds[0]
        if not stage:
            return compute
        return compute + 2 * self.cut_bytes[start - 1] * self.transfer_seconds_per_byte[stage - 1]


def stage_seconds(bounds: list[int], costs: StageCosts) -> list[float]:
    """Each stage's predicted seconds per micro-batch (``StageCosts.stage``) for the split at ``bounds``."""
    groups = _groups(bounds, len(costs.layer_seconds))
    return [costs.stage(stage, start, end) for stage, (start, end) in enumerate(groups)]


def pipelined_step_seconds(stage_seconds: list[float], micro_batches: int) -> float:
    """A step's predicted seconds on GPipe's schedule, from each stage's seconds per micro-batch: the
    first micro-batch passes through every stage, and each one after it adds the slowest stage's
    time, which the others wait for. Its second term is what the measured split minimises; with one
    micro-batch, only the first counts and no split can overlap anything."""
    return sum(stage_seconds) + (micro_batches - 1) * max(stage_seconds)


# A float32 variable costs a stage, while it trains, its own bytes, its gradient's, and its
# optimizer's slots: Adam keeps two moments per variable, Keras's SGD a momentum even at momentum 0.
FLOAT_BYTES = 4
SLOTS_PER_VARIABLE = {"adam": 2, "sgd": 1}
# What a stage replica takes before it holds any of the model: TensorFlow's own and a step's
# activations. On docker, wide_mlp's stage holding 704 MiB of state peaked at 1074 to 1141 MiB, and
# at a replica_memory_mb of 1200 a worker-0 was once killed (tests/test_cluster_docker_memory.py).
RUNTIME_MB = 512


class Unsplittable(ValueError):
    """No cut of the model gives every stage some of its variables within its replica's memory."""


@dataclass(frozen=True)
class StateLimits:
    """What every stage must hold: some of the model's variables (``parameters``, each layer's), and
    no more state (``bytes_per_parameter`` each: variable, gradient, slots) than ``stage_limit_bytes``
    (None: no limit)."""

    parameters: list[int]
    bytes_per_parameter: int
    stage_limit_bytes: int | None
    memory_mb: int = 0  # the replica_memory_mb the limit comes from, for the reasons given

    @classmethod
    def of(cls, spec: RunSpec, parameters: list[int]) -> StateLimits:
        """The spec's limits: across workers each stage is a replica of its own, held to
        ``replica_memory_mb`` less ``RUNTIME_MB``; on one replica's devices the stages share its
        memory, which no cut changes, so only the weights bind."""
        memory_mb = spec.cluster.stage_memory_mb
        limit = max(0, memory_mb - RUNTIME_MB) * 2**20 if memory_mb else None
        per_parameter = FLOAT_BYTES * (2 + SLOTS_PER_VARIABLE[spec.training.optimizer])
        return cls(list(parameters), per_parameter, limit, memory_mb)

    def state_bytes(self, start: int, end: int) -> int:
        return sum(self.parameters[start:end]) * self.bytes_per_parameter

    def holds_weights(self, start: int, end: int) -> bool:
        return any(self.parameters[start:end])

    def allows(self, start: int, end: int) -> bool:
        fits = self.stage_limit_bytes is None or self.state_bytes(start, end) <= self.stage_limit_bytes
        return self.holds_weights(start, end) and fits

    def unsplittable(self, stages: int) -> str | None:
        """Why no cut into ``stages`` stages is allowed, in one line; None where one is."""
        weighted = sum(1 for count in self.parameters if count)
        if stages > weighted:
            return f"the model has {weighted} layers with weights; {stages} stages cannot each hold some"
        layers = len(self.parameters)
        leanest = _best_cut(lambda stage, start, end: self.state_bytes(start, end), stages, layers, self.holds_weights)
        largest = max(self.state_bytes(start, end) for start, end in _groups(leanest, layers))
        if self.stage_limit_bytes is None or largest <= self.stage_limit_bytes:
            return None
        return (
            f"replica_memory_mb={self.memory_mb} is too small: every cut into {stages} stages gives a stage "
            f"{_mib(largest)} of variables, gradients and optimizer slots, beside TensorFlow's own {RUNTIME_MB} MiB; "
            f"expected at least {math.ceil(largest / 2**20) + RUNTIME_MB}"
        )

    def why(self, bounds: list[int], fastest: list[int]) -> str:
        """What bound the choice of ``bounds`` where ``fastest`` is the fastest cut by time alone."""
        groups = list(enumerate(_groups(fastest, len(self.parameters))))
        if all(self.allows(start, end) for _, (start, end) in groups):
            memory = f" and fits replica_memory_mb={self.memory_mb}" if self.stage_limit_bytes is not None else ""
            return f"time alone: the fastest cut gives every stage some of the weights{memory}"
        empty = [stage for stage, (start, end) in groups if not self.holds_weights(start, end)]
        if empty:
            return (
                f"the weights: the fastest cut by time alone, {fastest}, left stage {empty[0]} no variables; "
                f"{bounds} is the fastest that gives every stage some"
            )
        stage, (start, end) = next((s, g) for s, g in groups if not self.allows(*g))
        return (
            f"replica_memory_mb={self.memory_mb}: the fastest cut by time alone, {fastest}, gave stage {stage} "
            f"{_mib(self.state_bytes(start, end))} of state, more than the "
            f"{_mib(self.stage_limit_bytes)} a stage holds; {bounds} is the fastest that fits"
        )


def _mib(count: float) -> str:
    return f"{count / 2**20:.0f} MiB"


def _groups(bounds: list[int], layers: int) -> list[tuple[int, int]]:
    """Each stage's (start, end) layers for the split at ``bounds``."""
    return list(zip([0, *bounds], [*bounds, layers]))


def _best_cut(cost, stages: int, layers: int, allowed) -> list[int] | None:
    """The boundaries of the contiguous split of ``layers`` layers over ``stages`` stages, in order,
    whose largest ``cost(stage, start, end)`` is least, among the splits whose every group is
    ``allowed(start, end)``; every stage gets at least one layer. Among equal splits, the one with
    earlier boundaries; None where no split is allowed."""
    # best[s][j]: the largest cost when stages 0..s hold layers 0..j-1; cut[s][j]: where stage s starts.
    best = [[math.inf] * (layers + 1) for _ in range(stages)]
    cut = [[0] * (layers + 1) for _ in range(stages)]
    for end in range(1, layers + 1):
        if allowed(0, end):
            best[0][end] = cost(0, 0, end)
    for stage in range(1, stages):
        for end in range(stage + 1, layers + 1):
            for start in range(stage, end):
                if not allowed(start, end):
                    continue
                largest = max(best[stage - 1][start], cost(stage, start, end))
                if largest < best[stage][end]:
                    best[stage][end], cut[stage][end] = largest, start
    if best[stages - 1][layers] == math.inf:
        return None
    bounds, end = [], layers
    for stage in range(stages - 1, 0, -1):
        end = cut[stage][end]
        bounds.append(end)
    return bounds[::-1]


def split_by_time(costs: StageCosts, limits: StateLimits | None = None) -> list[int]:
    """The boundaries (as ``split_by_parameters`` returns them) of the contiguous split of the
    layers over the stages, in order, whose slowest stage is fastest (``stage_seconds``), among the
    splits ``limits`` allows (every stage some weights, none more state than its replica holds;
    None: any); every stage gets at least one layer. Among equal splits, the one with earlier
    boundaries. Unsplittable, naming why, where ``limits`` allows none."""
    layers, stages = len(costs.layer_seconds), len(costs.stage_work_seconds)
    bounds = _best_cut(costs.stage, stages, layers, limits.allows if limits else lambda start, end: True)
    if bounds is None:
        raise Unsplittable(limits.unsplittable(stages))
    return bounds


class StageSplitPlan(Strict):
    """plan.json's ``stage_split``: the model_parallel chief's split and the numbers behind it."""

    method: Literal["measured", "parameters"]
    devices: Annotated[list[Name], Field(min_length=1, max_length=MAX_WORKERS)]
    layers: Annotated[list[Name], Field(min_length=1, max_length=MAX_LAYERS)]
    parameters: Annotated[list[Count], Field(max_length=MAX_LAYERS)]
    layer_seconds: Annotated[list[Seconds], Field(max_length=MAX_LAYERS)]
    stage_work_seconds: Annotated[list[Annotated[float, Field(gt=0, le=MAX_SECONDS)]], Field(max_length=MAX_WORKERS)]
    cut_bytes: Annotated[list[Count], Field(max_length=MAX_LAYERS)]  # each layer's output, one micro-batch
    transfer_seconds_per_byte: Annotated[list[Seconds], Field(max_length=MAX_WORKERS)]  # stage i to stage i + 1
    bounds: Annotated[list[Count], Field(max_length=MAX_WORKERS)]
    stage_seconds: Annotated[list[Seconds], Field(max_length=MAX_WORKERS)]
    parameter_bounds: Annotated[list[Count], Field(max_length=MAX_WORKERS)]
    parameter_stage_seconds: Annotated[list[Seconds], Field(max_length=MAX_WORKERS)]

    def costs(self) -> StageCosts:
        return StageCosts(self.layer_seconds, self.stage_work_seconds, self.cut_bytes, self.transfer_seconds_per_byte)


class Stage(Strict):
    """One stage of a model_parallel run, as the pipeline recomputed it."""

    replica: str
    device: str
    layers: list[str]  # as the trained model names them
    predicted_seconds: float  # a micro-batch's forward and backward, and its transfers
    node: str | None = None  # the swarm node that ran it, where the run records one (summarize)


class StageSplit(Strict):
    """model_parallel's split as the pipeline takes it (``read_stage_split``)."""

    method: Literal["measured", "parameters"]
    stages: list[Stage]
    slowest_stage_seconds: float
    slowest_by_parameters_seconds: float
    predicted_step_seconds: float  # pipelined_step_seconds at the run's micro_batches
    predicted_step_by_parameters_seconds: float
    bound: str  # what decided the cut: time alone, every stage's share of the weights, or replica memory


def read_stage_split(path: Path, spec: RunSpec, training: TrainingRecord) -> StageSplit:
    """model_parallel's split as the pipeline takes it: plan.json's numbers (a replica's: read as
    data, every field typed), the split recomputed from them with this module's code, and the layer
    groups training.json (read by ``read_training``) says trained; NotRegularFile, one line naming
    the field, where the replica's split is not the one its numbers give. Returns each stage's
    layers (as the trained model names them) and predicted seconds, and the slowest stage by
    either method."""
    try:
        split = StageSplitPlan.model_validate(PlanFile.read(path).stage_split)
    except ValidationError as invalid:
        raise refused(path, invalid, within=("stage_split",)) from None
    stages, layers = len(split.devices), len(split.layers)
    workers = spec.cluster.worker.replicas
    expected = workers if workers > 1 else spec.cluster.worker_device(0).count
    across = [f"/job:worker/replica:0/task:{index}/device:CPU:0" for index in range(workers)]
    if (split.devices != across) if workers > 1 else stages != expected:
        raise NotRegularFile(f"{path}: stage_split.devices must be the run's {expected} stages: refused")
    same_length = {
        "parameters": layers,
        "layer_seconds": layers,
        "stage_work_seconds": stages,
        "cut_bytes": layers,
        "transfer_seconds_per_byte": stages - 1,
    }
    for field, length in same_length.items():
        if len(getattr(split, field)) != length:
            raise NotRegularFile(f"{path}: stage_split.{field} must hold {length} values: refused")
    costs = split.costs()
    by_parameters = split_by_parameters(split.parameters, stages)
    try:
        bounds, bound = chosen_split(spec, split.parameters, costs, by_parameters)
    except Unsplittable as unsplittable:
        raise NotRegularFile(f"{path}: stage_split: {unsplittable}: refused") from None
    trained = _trained_groups(training)
    if (
        split.method != spec.cluster.stage_split
        or split.bounds != bounds
        or [len(g) for g in trained] != _group_sizes(bounds, layers)
    ):
        raise NotRegularFile(
            f"{path}: stage_split.bounds must be {bounds}, the {spec.cluster.stage_split} split of its numbers, "
            f"and the layer groups trained: refused"
        )
    predicted, by_parameters_seconds = stage_seconds(bounds, costs), stage_seconds(by_parameters, costs)
    micro_batches = spec.cluster.micro_batches
    return StageSplit(
        method=spec.cluster.stage_split,
        stages=[
            Stage(replica=_replica(device), device=device, layers=names, predicted_seconds=seconds)
            for device, names, seconds in zip(split.devices, trained, predicted)
        ],
        slowest_stage_seconds=max(predicted),
        slowest_by_parameters_seconds=max(by_parameters_seconds),
        predicted_step_seconds=pipelined_step_seconds(predicted, micro_batches),
        predicted_step_by_parameters_seconds=pipelined_step_seconds(by_parameters_seconds, micro_batches),
        bound=bound,
    )


def chosen_split(
    spec: RunSpec, parameters: list[int], costs: StageCosts, by_parameters: list[int]
) -> tuple[list[int], str]:
    """The spec's split (by measured time within the spec's limits, or by parameters) and, in a line,
    what bound it; Unsplittable where no cut is allowed."""
    if spec.cluster.stage_split == "parameters":
        return by_parameters, "stage_split=parameters: about equal parameter counts"
    limits = StateLimits.of(spec, parameters)
    bounds = split_by_time(costs, limits)
    return bounds, limits.why(bounds, split_by_time(costs))


def _replica(device: str) -> str:
    """The replica a stage's device is on: worker-i across workers, else the one worker's."""
    task = re.search(r"/job:worker/replica:0/task:([0-9]+)/", device)
    return f"worker-{task.group(1)}" if task else "worker-0"


def _group_sizes(bounds: list[int], layers: int) -> list[int]:
    return [end - start for start, end in _groups(bounds, layers)]


def _trained_groups(training: TrainingRecord) -> list[list[str]]:
    """The layers each stage trained, in order, from training.json's layer placement."""
    groups: list[list[str]] = []
    previous = None
    for entry in training.layer_placement or []:
        if entry.device != previous:
            groups.append([])
            previous = entry.device
        groups[-1].append(entry.layer)
    return groups

"""Where model_parallel cuts the model: consecutive layer groups, one per stage, chosen by parameter
count or by measured time. No TensorFlow: the pipeline recomputes a replica's split with it.

A pipelined step runs at the pace of its slowest stage (``pipelined_step_seconds``), so the
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
    starts, ends = [0, *bounds], [*bounds, len(costs.layer_seconds)]
    return [costs.stage(stage, start, end) for stage, (start, end) in enumerate(zip(starts, ends))]


def pipelined_step_seconds(stage_seconds: list[float], micro_batches: int) -> float:
    """A step's predicted seconds on GPipe's schedule, from each stage's seconds per micro-batch: the
    first micro-batch passes through every stage, and each one after it adds the slowest stage's
    time, which the others wait for. Its second term is what the measured split minimises; with one
    micro-batch, only the first counts and no split can overlap anything."""
    return sum(stage_seconds) + (micro_batches - 1) * max(stage_seconds)


def split_by_time(costs: StageCosts) -> list[int]:
    """The boundaries (as ``split_by_parameters`` returns them) of the contiguous split of the
    layers over the stages, in order, whose slowest stage is fastest (``stage_seconds``); every
    stage gets at least one layer. Among equal splits, the one with earlier boundaries."""
    layers, stages = len(costs.layer_seconds), len(costs.stage_work_seconds)
    # best[s][j]: the slowest stage's time when stages 0..s hold layers 0..j-1; cut[s][j]: where stage s starts.
    best = [[math.inf] * (layers + 1) for _ in range(stages)]
    cut = [[0] * (layers + 1) for _ in range(stages)]
    for end in range(1, layers + 1):
        best[0][end] = costs.stage(0, 0, end)
    for stage in range(1, stages):
        for end in range(stage + 1, layers + 1):
            for start in range(stage, end):
                slowest = max(best[stage - 1][start], costs.stage(stage, start, end))
                if slowest < best[stage][end]:
                    best[stage][end], cut[stage][end] = slowest, start
    bounds, end = [], layers
    for stage in range(stages - 1, 0, -1):
        end = cut[stage][end]
        bounds.append(end)
    return bounds[::-1]


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
    by_time = split_by_time(costs)
    bounds = by_time if spec.cluster.stage_split == "measured" else by_parameters
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
    )


def _replica(device: str) -> str:
    """The replica a stage's device is on: worker-i across workers, else the one worker's."""
    task = re.search(r"/job:worker/replica:0/task:([0-9]+)/", device)
    return f"worker-{task.group(1)}" if task else "worker-0"


def _group_sizes(bounds: list[int], layers: int) -> list[int]:
    return [end - start for start, end in zip([0, *bounds], [*bounds, layers])]


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

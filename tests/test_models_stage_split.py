"""Where model_parallel cuts the model (``hetflow.models.stage_split``): the measured split is the
best contiguous one, counts what crosses each cut, and the pipeline takes a replica's split only
where its numbers give it."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from hetflow.models.stage_split import (
    StageCosts,
    pipelined_step_seconds,
    read_stage_split,
    split_by_parameters,
    split_by_time,
    stage_seconds,
)
from hetflow.paths import NotRegularFile
from hetflow.replica.training_json import Placement, TrainingRecord
from hetflow.spec import parse_spec


def no_transfers(layer_seconds: list[float], work: list[float]) -> StageCosts:
    return StageCosts(layer_seconds, work, [0] * len(layer_seconds), [0.0] * (len(work) - 1))


def slowest_by_brute_force(costs: StageCosts) -> float:
    """The slowest stage of the best split, trying every way to cut the layers into a group per stage."""
    layers, stages = len(costs.layer_seconds), len(costs.stage_work_seconds)
    cuts = itertools.combinations(range(1, layers), stages - 1)
    return min(max(stage_seconds(list(bounds), costs)) for bounds in cuts)


def test_the_measured_split_is_the_best_contiguous_split():
    generator = random.Random(7)
    for _ in range(200):
        layers, stages = generator.randint(2, 9), generator.randint(2, 4)
        if stages > layers:
            continue
        costs = StageCosts(
            layer_seconds=[generator.uniform(0.001, 0.05) for _ in range(layers)],
            stage_work_seconds=[generator.uniform(0.01, 0.1) for _ in range(stages)],
            cut_bytes=[generator.randint(0, 10**7) for _ in range(layers)],
            transfer_seconds_per_byte=[generator.uniform(0, 2e-9) for _ in range(stages - 1)],
        )
        bounds = split_by_time(costs)
        assert len(bounds) == stages - 1 and bounds == sorted(set(bounds)) and 0 < bounds[0] and bounds[-1] < layers
        assert max(stage_seconds(bounds, costs)) == pytest.approx(slowest_by_brute_force(costs))


def test_a_slower_worker_gets_less_of_the_model_than_the_parameter_count_gives_it():
    # The cnn: cheap, heavy in parameters at the end; worker 1 three times slower.
    layer_seconds = [0.002, 0.003, 0.002, 0.0025, 0.001, 0.0015, 0.002]
    parameters = [0, 320, 0, 18496, 0, 4160, 650]
    assert split_by_parameters(parameters, 2) == [4]
    assert split_by_time(no_transfers(layer_seconds, [0.008, 0.024])) == [5]  # worker 1 keeps the two dense layers
    assert split_by_time(no_transfers(layer_seconds, [0.008, 0.008])) == [3]


def test_a_stage_is_its_layers_seconds_at_its_devices_speed_and_what_crosses_the_cut_before_it():
    costs = StageCosts([0.001, 0.003], [0.01, 0.02], cut_bytes=[1000, 40], transfer_seconds_per_byte=[1e-6])
    # stage 1: 0.003 s twice as slow, and 1000 bytes forward and back at 1 us a byte
    assert stage_seconds([1], costs) == pytest.approx([0.001, 0.006 + 0.002])


def test_the_split_avoids_a_cut_that_a_large_activation_would_cross():
    equal = [0.01, 0.01, 0.01, 0.01]
    assert split_by_time(no_transfers(equal, [1.0, 1.0])) == [2]
    # layer 1's output is 1 MB: crossing it forward and back at 10 ns a byte costs a layer's time twice
    costly = StageCosts(equal, [1.0, 1.0], cut_bytes=[100, 10**6, 100, 10], transfer_seconds_per_byte=[1e-8])
    # [3]: 0.03 | 0.01 + 2 us; [1] would add its 2 us to a stage of 0.03; [2]: 0.02 | 0.02 + 20 ms
    assert split_by_time(costly) == [3]


def test_a_pipelined_step_waits_for_the_slowest_stage_after_the_first_micro_batch():
    # Stage 0 passes micro-batch 1 on at 1 s; stage 1, at 2 s each, then takes the four in turn: 1 + 4 x 2.
    assert pipelined_step_seconds([1.0, 2.0], micro_batches=4) == pytest.approx(9.0)
    # Unpipelined, a micro-batch passes through the stages one after the other.
    assert pipelined_step_seconds([1.0, 2.0], micro_batches=1) == pytest.approx(3.0)


PLAN = {
    "method": "measured",
    "devices": ["/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"],
    "layers": ["rescaling", "flatten", "dense", "logits"],
    "parameters": [0, 0, 8320, 1290],
    "layer_seconds": [0.001, 0.001, 0.002, 0.004],
    "stage_work_seconds": [0.01, 0.01],
    "cut_bytes": [3072, 3072, 512, 40],
    "transfer_seconds_per_byte": [1e-9],
    "bounds": [3],
    "stage_seconds": [0.005, 0.005],
    "parameter_bounds": [3],
    "parameter_stage_seconds": [0.005, 0.005],
}
SPEC_VALUES = {"strategy": "model_parallel", "workers": 2}
SPEC = parse_spec(SPEC_VALUES)


def trained(groups: list[int]) -> TrainingRecord:
    """training.json's layer placement for layer groups of these sizes, stage i on worker i."""
    names = iter(["rescaling_1", "flatten_1", "dense_1", "logits"])
    placement = []
    for stage, size in enumerate(groups):
        device = f"/job:worker/replica:0/task:{stage}/device:CPU:0"
        placement += [Placement.model_construct(layer=next(names), device=device) for _ in range(size)]
    return TrainingRecord.model_construct(layer_placement=placement)


def test_the_pipeline_recomputes_the_split_and_names_its_replica(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"stage_split": PLAN}))
    split = read_stage_split(path, SPEC, trained([3, 1]))
    assert [(stage.replica, stage.layers) for stage in split.stages] == [
        ("worker-0", ["rescaling_1", "flatten_1", "dense_1"]),
        ("worker-1", ["logits"]),
    ]
    # worker-1: the logits' 0.004 s, and the dense layer's 512 bytes forward and back at 1 ns a byte
    assert split.slowest_stage_seconds == pytest.approx(0.004 + 2 * 512 * 1e-9)
    pipelined = read_stage_split(path, parse_spec({**SPEC_VALUES, "micro_batches": 4}), trained([3, 1]))
    # worker-0's 4 ms passes micro-batch 1 on; worker-1 then takes all four in turn, at 4.001024 ms each
    assert pipelined.predicted_step_seconds == pytest.approx(0.004 + 4 * 0.004001024)


@pytest.mark.parametrize(
    ("change", "groups", "message"),
    [
        ({"bounds": [2]}, [2, 2], "stage_split.bounds must be [3], the measured split of its numbers"),
        ({}, [2, 2], "stage_split.bounds must be [3]"),  # trained other groups than planned
        ({"method": "parameters"}, [3, 1], "stage_split.bounds must be [3]"),
        ({"layer_seconds": [0.001, float("nan"), 0.002, 0.004]}, [3, 1], "stage_split.layer_seconds.1"),
        ({"stage_work_seconds": [0.01]}, [3, 1], "stage_split.stage_work_seconds must hold 2 values"),
        ({"transfer_seconds_per_byte": []}, [3, 1], "stage_split.transfer_seconds_per_byte must hold 1 values"),
        ({"cut_bytes": [1, 2]}, [3, 1], "stage_split.cut_bytes must hold 4 values"),
        ({"layers": ["x" * 300, "b", "c", "d"]}, [3, 1], "stage_split.layers.0"),
        ({"command": "rm -rf /"}, [3, 1], "stage_split.command: Extra inputs are not permitted"),
        (
            {"devices": ["/job:worker/replica:0/task:7/device:CPU:0", "/job:ps/replica:0/task:0/device:CPU:0"]},
            [3, 1],
            "stage_split.devices must be the run's 2 stages",
        ),
    ],
)
def test_a_split_its_numbers_do_not_give_is_refused_in_one_line(tmp_path, change, groups, message):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"stage_split": {**PLAN, **change}}, allow_nan=True))
    with pytest.raises(NotRegularFile) as refused:
        read_stage_split(path, SPEC, trained(groups))
    assert str(refused.value).startswith(f"{path}: ") and message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_spec_knows_how_many_layers_each_model_has():
    from hetflow.models.architectures import MODELS, layer_chain
    from hetflow.spec.sections import MODEL_LAYERS

    assert MODEL_LAYERS == {kind: len(layer_chain(kind, 10)) for kind in MODELS}

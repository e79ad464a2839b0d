"""Where model_parallel cuts the model (``hetflow.models.stage_split``): the measured split is the
best contiguous one, and the pipeline takes a replica's split only where its numbers give it."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from hetflow.models.stage_split import read_stage_split, split_by_parameters, split_by_time, stage_seconds
from hetflow.paths import NotRegularFile
from hetflow.replica.training_json import Placement, TrainingRecord
from hetflow.spec import parse_spec


def slowest_by_brute_force(layer_seconds: list[float], work: list[float]) -> float:
    """The slowest stage of the best split, trying every way to cut the layers into len(work) groups."""
    total, best = sum(layer_seconds), float("inf")
    for cuts in itertools.combinations(range(1, len(layer_seconds)), len(work) - 1):
        edges = [0, *cuts, len(layer_seconds)]
        slowest = max(w * sum(layer_seconds[a:b]) / total for w, a, b in zip(work, edges, edges[1:]))
        best = min(best, slowest)
    return best


def test_the_measured_split_is_the_best_contiguous_split():
    generator = random.Random(7)
    for _ in range(200):
        layers, stages = generator.randint(2, 9), generator.randint(2, 4)
        if stages > layers:
            continue
        layer_seconds = [generator.uniform(0.001, 0.05) for _ in range(layers)]
        work = [generator.uniform(0.01, 0.1) for _ in range(stages)]
        bounds = split_by_time(layer_seconds, work)
        assert len(bounds) == stages - 1 and bounds == sorted(set(bounds)) and 0 < bounds[0] and bounds[-1] < layers
        assert max(stage_seconds(bounds, layer_seconds, work)) == pytest.approx(
            slowest_by_brute_force(layer_seconds, work)
        )


def test_a_slower_worker_gets_less_of_the_model_than_the_parameter_count_gives_it():
    # The cnn: cheap, heavy in parameters at the end; worker 1 three times slower.
    layer_seconds = [0.002, 0.003, 0.002, 0.0025, 0.001, 0.0015, 0.002]
    parameters = [0, 320, 0, 18496, 0, 4160, 650]
    assert split_by_parameters(parameters, 2) == [4]
    assert split_by_time(layer_seconds, [0.008, 0.024]) == [5]  # worker 1 keeps only the two dense layers
    assert split_by_time(layer_seconds, [0.008, 0.008]) == [3]


PLAN = {
    "method": "measured",
    "devices": ["/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"],
    "layers": ["rescaling", "flatten", "dense", "logits"],
    "parameters": [0, 0, 8320, 1290],
    "layer_seconds": [0.001, 0.001, 0.002, 0.004],
    "stage_work_seconds": [0.01, 0.01],
    "bounds": [3],
    "stage_seconds": [0.005, 0.005],
    "parameter_bounds": [3],
    "parameter_stage_seconds": [0.005, 0.005],
}
SPEC = parse_spec({"strategy": "model_parallel", "workers": 2})


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
    assert split.slowest_stage_seconds == pytest.approx(0.01 * 4 / 8)


@pytest.mark.parametrize(
    ("change", "groups", "message"),
    [
        ({"bounds": [2]}, [2, 2], "stage_split.bounds must be [3], the measured split of its numbers"),
        ({}, [2, 2], "stage_split.bounds must be [3]"),  # trained other groups than planned
        ({"method": "parameters"}, [3, 1], "stage_split.bounds must be [3]"),
        ({"layer_seconds": [0.001, float("nan"), 0.002, 0.004]}, [3, 1], "stage_split.layer_seconds.1"),
        ({"stage_work_seconds": [0.01]}, [3, 1], "stage_split.stage_work_seconds must hold 2 values"),
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

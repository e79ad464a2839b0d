"""Where model_parallel cuts the model (``hetflow.models.stage_split``): the measured split is the
best contiguous one, counts what crosses each cut, and the pipeline takes a replica's split only
where its numbers give it."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from hetflow.models.stage_split import (
    StageCosts,
    StateLimits,
    Unsplittable,
    pipelined_step_seconds,
    read_stage_split,
    split_by_parameters,
    split_by_time,
    stage_seconds,
)
from hetflow.paths import NotRegularFile
from hetflow.replica.training_json import Placement, TrainingRecord
from hetflow.spec import SpecError, parse_spec


def no_transfers(layer_seconds: list[float], work: list[float]) -> StageCosts:
    return StageCosts(layer_seconds, work, [0] * len(layer_seconds), [0.0] * (len(work) - 1))


def slowest_by_brute_force(costs: StageCosts, allowed=lambda start, end: True) -> float:
    """The slowest stage of the best split whose every group is ``allowed``, trying every way to cut
    the layers into a group per stage; infinite where none is."""
    layers, stages = len(costs.layer_seconds), len(costs.stage_work_seconds)
    slowest = math.inf
    for bounds in itertools.combinations(range(1, layers), stages - 1):
        if all(allowed(start, end) for start, end in zip([0, *bounds], [*bounds, layers])):
            slowest = min(slowest, max(stage_seconds(list(bounds), costs)))
    return slowest


def random_costs(seed: int, cases: int):
    """(generator, StageCosts) of random layers, stages (no more than the layers) and transfers."""
    generator = random.Random(seed)
    for _ in range(cases):
        layers, stages = generator.randint(2, 9), generator.randint(2, 4)
        if stages > layers:
            continue
        yield (
            generator,
            StageCosts(
                layer_seconds=[generator.uniform(0.001, 0.05) for _ in range(layers)],
                stage_work_seconds=[generator.uniform(0.01, 0.1) for _ in range(stages)],
                cut_bytes=[generator.randint(0, 10**7) for _ in range(layers)],
                transfer_seconds_per_byte=[generator.uniform(0, 2e-9) for _ in range(stages - 1)],
            ),
        )


def test_the_measured_split_is_the_best_contiguous_split():
    for _, costs in random_costs(7, 200):
        layers, stages = len(costs.layer_seconds), len(costs.stage_work_seconds)
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


# The cut that gives worker-0 the dense layer and worker-1 the logits.
DENSE_THEN_LOGITS = [("worker-0", ["rescaling_1", "flatten_1", "dense_1"]), ("worker-1", ["logits"])]


def read_plan(tmp_path, plan: dict, groups: list[int]):
    """``read_stage_split`` of plan.json holding ``plan``, its layers trained in groups of ``groups``."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"stage_split": plan}))
    return read_stage_split(path, SPEC, trained(groups))


def test_the_pipeline_recomputes_the_split_and_names_its_replica(tmp_path):
    split = read_plan(tmp_path, PLAN, [3, 1])
    assert [(stage.replica, stage.layers) for stage in split.stages] == DENSE_THEN_LOGITS
    # worker-1: the logits' 0.004 s, and the dense layer's 512 bytes forward and back at 1 ns a byte
    assert split.slowest_stage_seconds == pytest.approx(0.004 + 2 * 512 * 1e-9)
    pipelined = read_stage_split(
        tmp_path / "plan.json", parse_spec({**SPEC_VALUES, "micro_batches": 4}), trained([3, 1])
    )
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


def test_the_spec_knows_how_many_layers_with_weights_each_model_has():
    from hetflow.models.architectures import MODELS
    from hetflow.replica.stage_profile import layer_parameters
    from hetflow.spec.sections import MODEL_WEIGHTED_LAYERS

    weighted = {kind: sum(1 for count in layer_parameters(kind, [32, 32, 3], 10) if count) for kind in MODELS}
    assert MODEL_WEIGHTED_LAYERS == weighted


# The default model on two workers as the run measured it (#58): every layer about 1.5 to 2 ms,
# the two without weights included, so time alone cuts it in the middle.
DEFAULT_MLP = {
    **PLAN,
    "layer_seconds": [0.0016, 0.0015, 0.0019, 0.0017],
    "stage_work_seconds": [0.05, 0.05],
    "bounds": [3],
    "stage_seconds": [0.005, 0.0017],
}


def test_the_default_model_on_two_workers_gives_each_worker_some_of_the_state(tmp_path):
    split = read_plan(tmp_path, DEFAULT_MLP, [3, 1])
    # worker-0 holds dense's 8320 parameters, worker-1 the logits' 1290: neither is left with none.
    assert [(stage.replica, stage.layers) for stage in split.stages] == DENSE_THEN_LOGITS
    assert split.bound == (
        "the weights: the fastest cut by time alone, [2], left stage 0 no variables; "
        "[3] is the fastest that gives every stage some"
    )
    with pytest.raises(NotRegularFile, match=r"stage_split.bounds must be \[3\]"):
        read_plan(tmp_path, {**DEFAULT_MLP, "bounds": [2]}, [2, 2])  # the split by time alone, stage 0 weightless


def test_among_the_cuts_that_give_every_stage_weights_within_its_memory_the_split_is_the_fastest():
    checked = 0
    for generator, costs in random_costs(11, 300):
        # A parameter is a byte here; a stage holds 10 at most.
        limits = StateLimits([generator.choice([0, 0, 1, 3, 6]) for _ in costs.layer_seconds], 1, 10)
        best = slowest_by_brute_force(costs, lambda start, end: 0 < sum(limits.parameters[start:end]) <= 10)
        if best == math.inf:
            with pytest.raises(Unsplittable):
                split_by_time(costs, limits)
            continue
        bounds = split_by_time(costs, limits)
        assert max(stage_seconds(bounds, costs)) == pytest.approx(best)
        checked += 1
    assert checked > 100


# wide_mlp on 8x8 digits: 64 inputs, four 4096x4096 layers, logits.
WIDE = [0, 0, 64 * 4096 + 4096, *[4096 * 4096 + 4096] * 4, 4096 * 10 + 10]


def test_no_stage_is_given_more_state_than_its_replica_holds():
    spec = parse_spec({**SPEC_VALUES, "replica_memory_mb": 1100})
    limits = StateLimits.of(spec, WIDE)
    # Adam: each float32 parameter, its gradient and two moments, 16 bytes; 1100 MiB less TF's own 512.
    assert (limits.bytes_per_parameter, limits.stage_limit_bytes) == (16, 588 * 2**20)
    # Time alone gives worker-1 the last three large layers (worker-0 is three times slower): 769 MiB.
    costs = no_transfers([0.001, 0.001, 0.01, 0.2, 0.2, 0.2, 0.2, 0.001], [0.03, 0.01])
    assert split_by_time(costs) == [4]
    assert split_by_time(costs, limits) == [5]  # two large layers each: 516 MiB and 513 MiB
    assert limits.why([5], [4]) == (
        "replica_memory_mb=1100: the fastest cut by time alone, [4], gave stage 1 769 MiB of state, "
        "more than the 588 MiB a stage holds; [5] is the fastest that fits"
    )
    # Within the limit time alone decides, and the line says so.
    assert StateLimits.of(spec, [0, 0, 8320, 1290]).why([3], [3]) == (
        "time alone: the fastest cut gives every stage some of the weights and fits replica_memory_mb=1100"
    )


def test_where_no_cut_can_hold_the_state_the_line_says_why_and_what_would():
    assert StateLimits([0, 0, 8320, 1290], 16, None).unsplittable(3) == (
        "the model has 2 layers with weights; 3 stages cannot each hold some"
    )
    assert StateLimits([0, 0, 8320, 1290], 16, None).unsplittable(2) is None
    too_small = StateLimits.of(parse_spec({**SPEC_VALUES, "replica_memory_mb": 1000}), WIDE)
    # The leanest cut: 266,240 + 2 x 16,781,312 parameters on stage 0, 16 bytes each: 516.2 MiB.
    assert too_small.unsplittable(2) == (
        "replica_memory_mb=1000 is too small: every cut into 2 stages gives a stage 516 MiB of variables, "
        "gradients and optimizer slots, beside TensorFlow's own 512 MiB; expected at least 1029"
    )
    assert StateLimits.of(parse_spec({**SPEC_VALUES, "replica_memory_mb": 1029}), WIDE).unsplittable(2) is None
    # One replica's devices share its memory: no cut changes what it holds, so only the weights bind.
    one_replica = parse_spec({"strategy": "model_parallel", "devices_per_worker": 2, "replica_memory_mb": 1000})
    assert StateLimits.of(one_replica, WIDE).stage_limit_bytes is None


def test_a_spec_with_more_stages_than_layers_with_weights_is_refused_in_one_line():
    with pytest.raises(SpecError) as refused:
        parse_spec({**SPEC_VALUES, "workers": 3})
    assert refused.value.problems == [
        "workers=3 is invalid with strategy=model_parallel and model=mlp: expected at most 2 "
        "(the model has 2 layers with weights; 3 stages cannot each hold some)"
    ]


def test_a_model_no_cut_fits_is_refused_before_any_replica_starts():
    from hetflow.records import DatasetRecord
    from hetflow.replica.stage_profile import refuse_unsplittable

    digits = DatasetRecord.model_construct(input_shape=[8, 8, 1], num_classes=10)
    wide = {**SPEC_VALUES, "model": "wide_mlp"}
    with pytest.raises(SpecError) as refused:
        refuse_unsplittable(parse_spec({**wide, "replica_memory_mb": 1000}), digits)
    assert refused.value.problems == [
        "model_parallel cannot split model=wide_mlp over workers=2: replica_memory_mb=1000 is too small: every cut "
        "into 2 stages gives a stage 516 MiB of variables, gradients and optimizer slots, beside TensorFlow's own "
        "512 MiB; expected at least 1029"
    ]
    refuse_unsplittable(parse_spec({**wide, "replica_memory_mb": 1029}), digits)
    refuse_unsplittable(parse_spec({**wide, "replica_memory_mb": 1000, "stage_split": "parameters"}), digits)

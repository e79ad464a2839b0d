"""A study's values, checked before any trial: one line per problem, in the spec's words."""

from __future__ import annotations

import pytest

from hetflow.spec import SpecError
from hetflow.tuning.form import study_values, tune_params
from hetflow.tuning.space import parse_study


def problems(values: dict) -> list[str]:
    with pytest.raises(SpecError) as refused:
        parse_study(values)
    return refused.value.problems


def test_each_bad_value_is_named_with_what_is_allowed():
    found = problems(
        {
            "target_accuracy": 0.9,
            "choices": {"strategy": ["one_device", "bogus"], "learning_rate": [0.1]},
            "ranges": {"learning_rate": [0.1, 0.01], "batch_size": [8.5, 64]},
        }
    )
    assert found == [
        "choices.learning_rate is invalid: expected one of strategy, workers, optimizer, lr_scaling, balance_batches",
        "ranges.learning_rate=[0.1, 0.01] is invalid: expected low < high",
        "ranges.batch_size=[8.5, 64.0] is invalid: expected whole numbers",
    ]
    assert problems({"target_accuracy": 0.9, "choices": {"strategy": ["one_device", "bogus"]}}) == [
        "choices.strategy='bogus' is invalid: no trial can use it (strategy=\"bogus\" is invalid: expected one of "
        "auto, one_device, mirrored, multi_worker_mirrored, parameter_server, model_parallel)"
    ]
    assert problems({"target_accuracy": 1.5, "base": {"epochs": 0, "target_accuracy": 0.5}}) == [
        "target_accuracy=1.5 is invalid: expected a number > 0 and <= 1",
        "base: epochs=0 is invalid: expected an integer >= 1 and <= 1000",
    ]


def test_a_choice_is_refused_only_when_no_combination_can_use_it():
    assert problems({"target_accuracy": 0.9, "choices": {"strategy": ["one_device"], "workers": [1, 2]}}) == [
        "choices.workers=2 is invalid: no trial can use it (workers=2 is invalid with strategy=one_device: "
        "expected 1 (several workers need multi_worker_mirrored, parameter_server, model_parallel or auto))"
    ]
    study = parse_study(
        {"target_accuracy": 0.9, "choices": {"strategy": ["one_device", "parameter_server"], "workers": [1, 2]}}
    )
    assert study.trial_values({"strategy": "parameter_server", "workers": 2})["ps"] == 1
    assert study.trial_values({"strategy": "one_device", "workers": 1})["ps"] == 0


def test_the_forms_defaults_make_a_valid_study():
    form = {name: param.value for name, param in tune_params().items()}
    study = parse_study(study_values(form))
    assert study.choices["strategy"] == ["multi_worker_mirrored", "parameter_server"]
    assert study.ranges == {"learning_rate": (0.0005, 0.01)}

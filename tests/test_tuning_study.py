"""The study's objective: launch to target as the record says it, believed only within what the
pipeline saw; a trial that missed the target ranks below every one that reached it."""

from __future__ import annotations

from hetflow.replica.training_json import History, TrainingRecord
from hetflow.tuning.space import parse_study
from hetflow.tuning.study import objective_value

STUDY = parse_study({"target_accuracy": 0.9, "budget_seconds": 600})


def record(reached_at, accuracies=(0.5, 0.92)) -> TrainingRecord:
    """What the objective reads of a training record."""
    history = History.model_construct(val_accuracy=list(accuracies))
    return TrainingRecord.model_construct(history=history, launched_at=1000.0, target_reached_at=reached_at)


def test_the_time_to_target_is_the_records_within_what_the_pipeline_saw():
    assert objective_value(STUDY, record(1012.5), launched_wall=20.0) == (12.5, 12.5)
    for lie in (990.0, 1100.0):  # before its launch, or after the pipeline saw it end
        value, seconds = objective_value(STUDY, record(lie), launched_wall=20.0)
        assert seconds is None and value > 600


def test_a_missed_target_ranks_below_any_reached_and_by_its_best_accuracy():
    closer, _ = objective_value(STUDY, record(None, (0.5, 0.85)), launched_wall=20.0)
    farther, _ = objective_value(STUDY, record(None, (0.5, 0.6)), launched_wall=20.0)
    slowest_reached, _ = objective_value(STUDY, record(1000.0 + 599), launched_wall=600.0)
    assert slowest_reached < closer < farther

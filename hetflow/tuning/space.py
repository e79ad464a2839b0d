"""What a tuning study searches, for what and within what: the ``hetflow_tune`` form's values and
``hetflow tune``'s config, checked as the train form's are (one line per problem, naming the field
and what is allowed) before any trial starts."""

from __future__ import annotations

import itertools
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hetflow.spec import SpecError, parse_spec

# What a study may search (the spec's short names): choices, and ranges (low, high).
CHOICE_KEYS = ("strategy", "workers", "optimizer", "lr_scaling", "balance_batches")
RANGE_KEYS = ("learning_rate", "batch_size", "warmup_epochs")
INTEGER_RANGES = ("batch_size",)
MAX_COMBINATIONS_CHECKED = 2000
# Keys a study sets for every trial itself: its target, and data prepared once for all trials.
STUDY_SETS = ("target_accuracy", "skip_unchanged")


class StudySpec(BaseModel):
    """One study: every trial is ``base`` plus one draw from ``choices`` and ``ranges``, trained
    until ``target_accuracy`` (validation) or its epochs end; the study ends after ``trials``
    finished trials or ``budget_seconds`` of wall time, whichever comes first."""

    model_config = ConfigDict(extra="forbid")

    base: dict[str, Any] = Field(default_factory=dict, description="spec keys every trial shares")
    choices: dict[str, list[Any]] = Field(default_factory=dict)
    ranges: dict[str, tuple[float, float]] = Field(default_factory=dict)
    target_accuracy: float = Field(gt=0, le=1)
    trials: int = Field(8, ge=1, le=200)
    budget_seconds: int = Field(3600, ge=60, le=7 * 24 * 3600)
    async_ps: int = Field(1, ge=1, le=8, description="parameter servers of a parameter_server trial")
    pruning: bool = Field(True, description="stop a trial behind the earlier ones (false: every trial runs to its end)")
    parallel_trials: int = Field(
        1, ge=1, le=8, description="trials run at once, each on its own cluster (where the backend has room for them)"
    )
    seed: int = Field(0, ge=0)

    def trial_values(self, drawn: dict[str, Any]) -> dict[str, Any]:
        """The spec values of a trial that drew ``drawn``: a parameter_server trial gets
        ``async_ps`` parameter servers, every other none."""
        values = {**self.base, **drawn, "target_accuracy": self.target_accuracy, "skip_unchanged": False}
        strategy = values.get("strategy", parse_spec({}).cluster.strategy)
        values["ps"] = self.async_ps if strategy == "parameter_server" else 0
        return values


# What each of the study's own fields allows, in the spec's words.
ALLOWED = {
    "target_accuracy": "a number > 0 and <= 1",
    "trials": "an integer >= 1 and <= 200",
    "budget_seconds": "an integer >= 60 and <= 604800",
    "async_ps": "an integer >= 1 and <= 8",
    "seed": "an integer >= 0",
    "parallel_trials": "an integer >= 1 and <= 8",
    "pruning": "true or false",
    "base": "an object of spec keys",
    "choices": "an object: a list of values per key",
    "ranges": "an object: [low, high] per key",
}


def _one_line(error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden":
            problems.append(f"{where} is invalid: expected one of {', '.join(StudySpec.model_fields)}")
            continue
        allowed = ALLOWED.get(str(item["loc"][0]), item["msg"])
        problems.append(f"{where}={json.dumps(item.get('input'))} is invalid: expected {allowed}")
    return problems


def _spec_problems(values: dict[str, Any], field: str) -> list[str]:
    try:
        parse_spec(values)
    except SpecError as error:
        return [f"{field}: {problem}" for problem in error.problems]
    return []


def _choices_checked(study: StudySpec) -> tuple[list[str], dict[str, Any] | None]:
    """One line for each choice that no combination with the other choices makes a valid spec
    (``workers=2`` is fine beside ``strategy=multi_worker_mirrored``, useless beside only
    ``one_device``), with the first reason it was refused; and the first valid combination (None
    if there is none), beside which the ranges are checked."""
    keys = list(study.choices)
    combinations = list(itertools.islice(itertools.product(*study.choices.values()), MAX_COMBINATIONS_CHECKED))
    usable: dict[str, set[int]] = {key: set() for key in keys}
    reasons: dict[tuple[str, int], str] = {}
    first_valid = None
    for combination in combinations:
        drawn = dict(zip(keys, combination))
        problems = _spec_problems(study.trial_values(drawn), "choices")
        if not problems and first_valid is None:
            first_valid = drawn
        for key, option in drawn.items():
            index = study.choices[key].index(option)
            if not problems:
                usable[key].add(index)
            else:
                reasons.setdefault((key, index), problems[0].removeprefix("choices: "))
    if len(combinations) == MAX_COMBINATIONS_CHECKED:
        return [], first_valid  # too many to try each: combinations are checked as trials draw them
    refused = [
        f"choices.{key}={option!r} is invalid: no trial can use it ({reasons[(key, index)]})"
        for key in keys
        for index, option in enumerate(study.choices[key])
        if index not in usable[key]
    ]
    return refused, first_valid


def _base_problems(base: dict[str, Any]) -> list[str]:
    """The base's own bad values (unknown keys, out of range), not how it combines with the defaults."""
    return [problem for problem in _spec_problems(base, "base") if " is invalid with " not in problem]


def parse_study(values: dict[str, Any]) -> StudySpec:
    """The study, or SpecError listing every problem (nothing has started)."""
    try:
        study = StudySpec.model_validate(values)
    except ValidationError as error:
        base = values.get("base", {})
        raise SpecError(_one_line(error) + (_base_problems(base) if isinstance(base, dict) else [])) from None
    problems = []
    for key in STUDY_SETS:
        if key in study.base:
            problems.append(f"base.{key} is invalid: the study sets it for every trial (use target_accuracy)")
    # A base that only the choices complete (workers=2, strategies to try) is checked with them below.
    problems += _base_problems(study.base) if study.choices else _spec_problems(study.trial_values({}), "base")
    for key, options in study.choices.items():
        if key not in CHOICE_KEYS:
            problems.append(f"choices.{key} is invalid: expected one of {', '.join(CHOICE_KEYS)}")
        elif not options:
            problems.append(f"choices.{key}=[] is invalid: expected at least one value")
    beside = {}
    if not problems:
        refused, beside = _choices_checked(study)
        problems += refused
    for key, (low, high) in study.ranges.items():
        if key not in RANGE_KEYS:
            problems.append(f"ranges.{key} is invalid: expected one of {', '.join(RANGE_KEYS)}")
        elif not low < high:
            problems.append(f"ranges.{key}=[{low}, {high}] is invalid: expected low < high")
        elif key in INTEGER_RANGES and not (float(low).is_integer() and float(high).is_integer()):
            problems.append(f"ranges.{key}=[{low}, {high}] is invalid: expected whole numbers")
        else:
            for end in (low, high):
                drawn = {**(beside or {}), key: int(end) if key in INTEGER_RANGES else end}
                problems += _spec_problems(study.trial_values(drawn), f"ranges.{key}")
    if problems:
        raise SpecError(problems)
    return study


def figure(value: Any) -> str:
    """A value as a log line shows it: a float to 3 significant digits (``learning_rate=0.00314``)."""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def settings_words(settings: dict[str, Any]) -> str:
    """A trial's settings in a line: ``strategy=parameter_server, workers=2, learning_rate=0.00314``."""
    return ", ".join(f"{key}={figure(value)}" for key, value in settings.items()) or "the base spec alone"


def study_words(study: StudySpec) -> str:
    """What a study searches, for what and within what, in a line."""
    searched = [f"{key} {' or '.join(figure(option) for option in options)}" for key, options in study.choices.items()]
    searched += [f"{key} from {figure(low)} to {figure(high)}" for key, (low, high) in study.ranges.items()]
    at_once = f", {study.parallel_trials} at a time," if study.parallel_trials > 1 else ""
    shared = f"; every trial with {settings_words(study.base)}" if study.base else ""
    return (
        f"{study.trials} trials{at_once} to validation accuracy {study.target_accuracy:g} within "
        f"{study.budget_seconds} s, trying {'; '.join(searched) or 'the base spec alone'}{shared}; "
        f"pruning {'on' if study.pruning else 'off'}, seed {study.seed}"
    )

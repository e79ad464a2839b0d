"""The hetflow_tune trigger form: the search space in the train form's terms (a list of choices per
key, a [low, high] range per key), the target, the budget, and the spec every trial shares."""

from __future__ import annotations

from typing import Any

from hetflow.spec import KEYS
from hetflow.spec.form import form_param, typed_number
from hetflow.tuning.space import ALLOWED, CHOICE_KEYS, RANGE_KEYS

_SPEC_KEY = {key.short: key for key in KEYS}
DEFAULT_CHOICES = {"strategy": ["multi_worker_mirrored", "parameter_server"], "workers": [2]}
DEFAULT_RANGES = {"learning_rate": [0.0005, 0.01]}
DEFAULT_BASE = {"model": "mlp", "epochs": 15}
# The study's own fields: (title, help, JSON type, default), titled and explained as the train form's are.
_STUDY_FIELDS = {
    "target_accuracy": ("Target accuracy", "The validation accuracy each trial races to.", "number", 0.9),
    "trials": ("Trials", "How many trials the study runs.", "integer", 6),
    "budget_seconds": (
        "Time budget (seconds)",
        "Wall time of the whole study, checked between trials: no trial starts after it.",
        "integer",
        3600,
    ),
    "parallel_trials": (
        "Trials at once",
        "Trials run side by side, each on a cluster of its own: more only where the backend has room for "
        "them, since trials that share CPUs slow each other down and the study compares their times.",
        "integer",
        1,
    ),
    "base": (
        "Every trial's spec",
        "Spec keys every trial shares, as a JSON object of short names (as `--set` takes them), "
        'e.g. `{"model": "mlp", "epochs": 15}`.',
        "object",
        DEFAULT_BASE,
    ),
}


def tune_params() -> dict[str, Any]:
    """The DAG's ``Param``s: a field per searchable key (empty: not searched), then the study's own."""
    params: dict[str, Any] = {}
    for short in CHOICE_KEYS:
        schema = _SPEC_KEY[short].schema()
        params[short] = form_param(
            DEFAULT_CHOICES.get(short, []),
            type=["array", "null"],  # optional: empty searches nothing
            items={key: schema[key] for key in ("type", "enum") if key in schema},
            title=f"{schema['title']}: values to try",
            description_md=f"{schema['title']}: the values the study tries (empty: the base spec's).",
            section="Search space",
        )
    for short in RANGE_KEYS:
        title = _SPEC_KEY[short].schema()["title"]
        params[f"{short}_range"] = form_param(
            DEFAULT_RANGES.get(short, []),
            type=["array", "null"],
            items={"type": "number"},
            title=f"{title}: range",
            description_md=f"{title}: `[low, high]` the study draws from (empty: the base spec's).",
            section="Search space",
        )
    for name, (title, help_text, json_type, default) in _STUDY_FIELDS.items():
        typed = {"type": json_type} if json_type == "object" else typed_number(json_type)
        params[name] = form_param(
            default, **typed, title=title, description_md=f"{help_text} Allowed: {ALLOWED[name]}.", section="Study"
        )
    return params


def study_values(form: dict[str, Any]) -> dict[str, Any]:
    """The form's values (or a conf's) as ``parse_study`` takes them."""
    values = {
        key: form[key]
        for key in ("target_accuracy", "trials", "budget_seconds", "parallel_trials", "base")
        if key in form
    }
    values["choices"] = {key: form[key] for key in CHOICE_KEYS if form.get(key)}
    values["ranges"] = {key: form[f"{key}_range"] for key in RANGE_KEYS if form.get(f"{key}_range")}
    unknown = set(form) - set(values) - set(CHOICE_KEYS) - {f"{key}_range" for key in RANGE_KEYS}
    values.update({key: form[key] for key in unknown})  # refused by name in parse_study
    return values

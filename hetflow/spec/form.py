"""The trigger form: one Airflow ``Param`` per key, keyed by its short name, in its section."""

from __future__ import annotations

import functools
import json
import math
from typing import Any

from hetflow.spec.messages import allowed_values, field_schema
from hetflow.spec.run_spec import KEYS

# Airflow validates every Param against its schema ~3,400 times a DAG run (serializing the DAG
# compares and prints each task's params), and jsonschema checks the schema against its meta-schema
# at every call: draft 2020-12's (the default) costs 3x draft-07's, ~2 s of each run. The forms use
# draft-07's keywords only.
SCHEMA_DRAFT = "http://json-schema.org/draft-07/schema#"


def form_param(default: Any, **schema: Any):
    """An Airflow ``Param`` of ``default`` and ``schema``, declared draft-07 (SCHEMA_DRAFT)."""
    from airflow.sdk import Param  # here, not at the top: the replica imports the spec, never Airflow

    return Param(default, **schema, **{"$schema": SCHEMA_DRAFT})


def typed_number(json_type: str) -> dict[str, Any]:
    """The schema of a number field typed as text, as Airflow 3.3's form draws fields from a Param's
    schema (its FieldSelector): a single number type is a number input, which shows NaN for a typed
    "-" and drops typed letters; a field of several types without ``examples`` is a six-line JSON
    box that re-parses what is typed at every key ("0.0" becomes "0"); one whose first type is
    "string" and that has ``examples`` is a text input with a list of suggestions (Chromium draws a
    ▼ where the list holds any) and "Start typing to see options" even where it is empty. So the
    field takes text ("string" first) and no suggestion (``examples`` empty); plugins/ui_theme.json
    hides that placeholder where the list is empty. The server checks the text as typed
    ('epochs="-1" is invalid: ...') and records it as the number it spells
    (``numbers_as_numbers``); a number sent as a number validates as one."""
    return {"type": ["string", json_type], "examples": []}


@functools.cache
def _number_types() -> dict[str, str]:
    """The JSON type of every number key, by the names a conf may use for it (short and dotted)."""
    types = {}
    for key in KEYS:
        json_type = field_schema(key).get("type")
        if json_type in ("integer", "number"):
            types |= {key.short: json_type, key.dotted: json_type}
    return types


def numbers_as_numbers(conf: dict[str, Any]) -> dict[str, Any]:
    """``conf`` with each number typed as text (the form sends "2" for Workers) as the number it
    spells, as the spec reads it, so that the run's conf records 2 as a REST caller's does. Text
    that spells no number of the key's type ("2.5" for an integer, "-", "ten") stays as typed: the
    spec refuses it by name."""
    converted = dict(conf)
    for name, value in conf.items():
        json_type = _number_types().get(name)
        if json_type is None or not isinstance(value, str):
            continue
        try:
            number = json.loads(value)
        except ValueError:
            continue
        wanted = int if json_type == "integer" else (int, float)
        if isinstance(number, wanted) and not isinstance(number, bool) and math.isfinite(number):
            converted[name] = number
    return converted


def form_section(key) -> str:
    """The form's section of ``key``: a field only some backends read is in a section named for them
    ("Cluster on kubernetes"), which the form shows closed like every section but the first, so a run
    on local processes reads only the fields it uses."""
    return f"{key.section} on {', '.join(key.backends)}" if key.backends else key.section


def airflow_params() -> dict[str, Any]:
    """The DAG's ``Param``s (the trigger form), generated from the RunSpec schema."""
    params = {}
    for key in KEYS:
        schema = field_schema(key)
        for extra in ("short", "backends"):
            schema.pop(extra, None)
        json_type = schema.pop("type")
        description = schema.pop("description")
        if json_type in ("integer", "number"):
            description += f" Allowed: {allowed_values(key)}."
        if key.backends:
            description += f" Empty: {json.dumps(key.field.default)}."
        if json_type in ("integer", "number"):
            typed = typed_number(json_type)
            json_type = typed.pop("type")
            schema |= typed
        if schema.pop("nullable", False) or key.backends:
            json_type = [*json_type, "null"] if isinstance(json_type, list) else [json_type, "null"]
        # The form's number input clamps what was typed into a top-level minimum/maximum when it
        # loses focus (-1 in Epochs silently became 1). Under allOf the bounds still refuse the
        # value at trigger time, and the description states them.
        bounds = {bound: schema.pop(bound) for bound in ("minimum", "maximum") if bound in schema}
        if bounds:
            schema["allOf"] = [bounds]
        # description_md (with no plain description) renders in the form as Markdown.
        params[key.short] = form_param(
            key.field.default, type=json_type, description_md=description, section=form_section(key), **schema
        )
    return params

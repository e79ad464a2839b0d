"""The trigger form: one Airflow ``Param`` per key, keyed by its short name, in its section."""

from __future__ import annotations

import json
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


def typed_number(json_type: str, default: Any) -> dict[str, Any]:
    """The schema of a number field typed as text. A number input shows NaN for a typed "-" and drops
    typed letters: the field takes text ("string" first: Airflow's form draws a field for the first
    type), which the server checks as typed ('epochs="-1" is invalid: ...'); a number sent as a
    number still validates as one. The examples (the default) keep the form from drawing a field of
    several types as a six-line JSON box."""
    return {"type": ["string", json_type], "examples": [] if default is None else [default]}


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
            typed = typed_number(json_type, key.field.default)
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

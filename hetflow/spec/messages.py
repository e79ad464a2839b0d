"""The spec's messages: one line per problem, naming the key people type, the value and what is
allowed, and the ``--set key=value`` reader."""

from __future__ import annotations

import copy
import difflib
import json
from typing import Any

from hetflow.spec.keys import Key


class SpecError(ValueError):
    """Invalid spec: one line per problem, each naming the key, the value and what is allowed."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def field_schema(key: Key) -> dict[str, Any]:
    """The JSON schema of one key, flattened: `int | None` renders as anyOf [{integer, bounds},
    {null}], and a one-value Literal as `const`; the form and the messages want plain keywords."""
    schema = copy.deepcopy(key.schema())
    schema.pop("default", None)
    branches = schema.pop("anyOf", None)
    if branches:
        typed = [b for b in branches if b.get("type") != "null"]
        schema.update(typed[0])
        schema["nullable"] = len(typed) < len(branches)
    if "const" in schema:
        schema["enum"] = [schema.pop("const")]
    reference = schema.get("items", {}).get("$ref")
    if reference:  # a list of sub-models: the form needs the item schema inline
        schema["items"] = copy.deepcopy(key.item_schema(reference))
    return schema


_TYPE_WORDS = {"integer": "an integer", "number": "a number", "boolean": "true or false", "string": "a string"}


def allowed_values(key: Key) -> str:
    schema = field_schema(key)
    if "enum" in schema:
        return "one of " + ", ".join(str(v) for v in schema["enum"])
    if schema.get("type") == "array" and "enum" in schema["items"]:
        items = schema["items"]["enum"]
        return f"a list of {schema.get('minItems', 0)} or more of " + ", ".join(items)
    if schema.get("type") == "array":
        return "a list of objects with keys " + ", ".join(schema["items"]["properties"])
    bounds = [
        f"{sign} {schema[bound]}"
        for bound, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))
        if bound in schema
    ]
    words = _TYPE_WORDS.get(schema.get("type", ""), "a value")
    if bounds:
        words += " " + " and ".join(bounds)
    if "pattern" in schema:
        words += f" matching {schema['pattern']}"
    if schema.get("nullable"):
        words += ", or empty"
    return words


def unknown_key_line(name: str, value: Any, keys: list[Key]) -> str:
    """A key that is neither a short name nor a path: the nearest of both, and the short names."""
    guess = difflib.get_close_matches(name, [k.short for k in keys] + [k.dotted for k in keys], n=1)
    hint = f" (did you mean {guess[0]!r}?)" if guess else ""
    allowed = ", ".join(k.short for k in keys)
    return f"unknown key {name!r}={json.dumps(value, default=str)}{hint}; allowed keys: {allowed}"


def invalid_line(error: dict[str, Any], key: Key | None, rest: tuple[Any, ...]) -> str:
    """A pydantic error as one line; ``rest`` is its location below the key (an element of a list)."""
    value = json.dumps(error.get("input"), default=str)
    if key is None:
        return f"{value} is invalid: {error['msg']}"
    if error["type"] == "extra_forbidden" and len(rest) > 1:
        allowed = ", ".join(field_schema(key)["items"]["properties"])
        return f"unknown key {key.short}[{rest[0]}].{rest[1]}; allowed keys: {allowed}"
    if len(rest) > 1:  # a field of a list element (worker_devices[1].slowdown)
        field = ".".join(str(part) for part in rest[1:])
        return f"{key.short}[{rest[0]}].{field}={value} is invalid: {error['msg'].lower()}"
    item = "".join(f"[{index}]" for index in rest)  # an element of a list
    return f"{key.short}{item}={value} is invalid: expected {allowed_values(key)}"


def parse_assignment(assignment: str) -> tuple[str, Any]:
    """``key=value`` from the command line; the value is read as JSON when it parses (3, 0.1, true, null)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise SpecError([f"--set {assignment!r} is invalid: expected KEY=VALUE"])
    try:
        return key.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw

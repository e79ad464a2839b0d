"""docs/spec.md, the spec reference, generated from RunSpec: ``python -m hetflow.spec.reference > docs/spec.md``
(``make docs``). tests/test_spec_reference.py fails when the file is stale."""

from __future__ import annotations

import json

from hetflow.spec.messages import allowed_values, field_schema
from hetflow.spec.run_spec import KEYS

HEADER = """# The run spec

<!-- Generated from hetflow/spec/ by `make docs` (python -m hetflow.spec.reference); do not edit. -->

Every key can be given by its short name or by its path: `--set workers=2` and
`--set cluster.worker.replicas=2` are the same, on the command line (`--set`), in a `--config` JSON
file (flat, or nested in sections), in the trigger form and in a triggered run's conf. One
exception: a triggered run's conf cannot give the `model` section as an object, as `model` is also
the architecture's short name, a field of the form, and Airflow checks the conf against the form
before hetflow reads it; give `model.architecture` (or `model`) there. `spec.json` and
`summary.json` hold the spec in sections; MLflow params hold the short names.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type(key) -> str:
    schema = field_schema(key)
    words = schema.get("type", "value")
    if words == "array":
        words = "list of " + schema["items"].get("type", "objects")
    return words + (" or empty" if schema.get("nullable") else "")


def reference() -> str:
    lines = [HEADER]
    section = None
    for key in KEYS:
        if key.section != section:
            section = key.section
            lines += [
                f"\n## {section}\n",
                "| short name | path | type | default | allowed | description |",
                "|---|---|---|---|---|---|",
            ]
        description = key.field.description
        if key.backends:
            description += f" Read by backend {', '.join(key.backends)} only; empty means the default."
        allowed, pattern = allowed_values(key), field_schema(key).get("pattern")
        if pattern:
            allowed = allowed.replace(pattern, f"`{pattern}`")
        cells = [
            f"`{key.short}`",
            f"`{key.dotted}`",
            _type(key),
            f"`{json.dumps(key.field.default)}`",
            allowed,
            description,
        ]
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference(), end="")

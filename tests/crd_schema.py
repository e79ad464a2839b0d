"""A vendored CustomResourceDefinition's schema as a validator (tests/schemas/README.md: where each
comes from): the TFJob's and the InferenceService's manifests are checked against the operators' own
CRDs, with no cluster."""

from __future__ import annotations

from pathlib import Path

import yaml

SCHEMAS = Path(__file__).parent / "schemas"


def closed(schema):
    """The CRD's schema as the API server applies it to our objects: a field it does not declare
    would be pruned silently, so here it is an error (objects that preserve unknown fields stay open)."""
    if isinstance(schema, dict):
        schema = {key: closed(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            if not schema.get("x-kubernetes-preserve-unknown-fields"):
                schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [closed(item) for item in schema]
    return schema


def crd_validator(file_name: str, version: str):
    """A Draft 7 validator of the CRD's ``version`` (KServe's is 2 MB: libyaml's loader reads it in
    about a second, the pure-Python one in ten)."""
    import jsonschema

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((SCHEMAS / file_name).read_text(), Loader=loader)
    [found] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(closed(found["schema"]["openAPIV3Schema"]))


def errors(validator, document: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(document)]

"""The spec's keys: each leaf of RunSpec with its short name (the key people type) and its path."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from hetflow.spec.sections import field_backends, short_name


@dataclass(frozen=True)
class Key:
    short: str  # the key people type, flat: --set, --config, the form, conf, MLflow params
    path: tuple[str, ...]  # where it lives in RunSpec: ("cluster", "worker", "replicas")
    owner: type[BaseModel]  # the section model that declares it
    section: str  # the title of its top-level section (the trigger form's section)

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def field(self) -> FieldInfo:
        return self.owner.model_fields[self.path[-1]]

    @property
    def backends(self) -> list[str]:
        return field_backends(self.field)

    def schema(self) -> dict[str, Any]:
        """The field's JSON schema, and its items' model inline where it is a list of models."""
        return _schema(self.owner)["properties"][self.path[-1]]

    def item_schema(self, reference: str) -> dict[str, Any]:
        return _schema(self.owner)["$defs"][reference.rsplit("/", 1)[1]]


@functools.cache
def _schema(owner: type[BaseModel]) -> dict[str, Any]:
    """A section's JSON schema, built once: the DAG file reads it for every field at parse time."""
    return owner.model_json_schema()


def is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def walk(model: type[BaseModel], prefix: tuple[str, ...] = (), section: str = "") -> list[Key]:
    """Every leaf under ``model``, in declaration order (the form's order)."""
    keys = []
    for name, field in model.model_fields.items():
        if is_section(field.annotation):
            keys += walk(field.annotation, (*prefix, name), section or field.annotation.model_config["title"])
        else:
            keys.append(Key(short_name(name, field), (*prefix, name), model, section))
    return keys

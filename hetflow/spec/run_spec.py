"""RunSpec: the one typed, validated description of a run, in sections (data, model, cluster,
training, compression, export, registry).

Every key has a short name (the flat key users type and records hold: ``workers``) and a path
(``cluster.worker.replicas``). ``--set``, ``--config``, the trigger form, conf and retrain
overrides accept either, and a section given as an object; spec.json holds the sections, MLflow
params and the training key the flat keys (``flat()``), as they did before the sections.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetflow.cluster.backends import supports
from hetflow.spec.cluster import ClusterSpec
from hetflow.spec.keys import Key, walk
from hetflow.spec.messages import SpecError, invalid_line, unknown_key_line
from hetflow.spec.sections import (
    MODEL_WEIGHTED_LAYERS,
    CompressionSpec,
    DataSpec,
    ExportSpec,
    ModelSpec,
    RegistrySpec,
    TrainingSpec,
    model_named_after,
)


class RunSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    data: DataSpec = Field(default_factory=DataSpec)
    model: ModelSpec = Field(default_factory=ModelSpec)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)
    registry: RegistrySpec = Field(default_factory=RegistrySpec)

    @model_validator(mode="before")
    @classmethod
    def _model_named_after_its_data(cls, values: Any) -> Any:
        """registered_model left empty: the dataset's name (``model_named_after``), in the spec every
        stage and record reads, so that it is decided once."""
        if not isinstance(values, dict):
            return values
        registry, data = values.get("registry") or {}, values.get("data") or {}
        if not (isinstance(registry, dict) and isinstance(data, dict)) or registry.get("model_name") is not None:
            return values
        dataset = data.get("dataset", DataSpec.model_fields["dataset"].default)
        if not isinstance(dataset, str):
            return values  # the data section's own check names what is wrong
        return {**values, "registry": {**registry, "model_name": model_named_after(dataset)}}

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> RunSpec:
        """A spec from short names, paths or sections (missing keys take defaults; of two values for
        one key the later wins, as in a dict merge); SpecError lists every problem of a single key.
        Checks across keys are ``parse_spec``'s: a recorded spec is read as it was written."""
        nested: dict[str, Any] = {}
        unknown = []
        for name, value in flat_values(values).items():
            key = BY_SHORT.get(name)
            if key is None:
                unknown.append(unknown_key_line(name, value, KEYS))
                continue
            node = nested
            for part in key.path[:-1]:
                node = node.setdefault(part, {})
            node[key.path[-1]] = value
        try:
            spec = cls.model_validate(nested)
        except ValidationError as exc:
            raise SpecError([_error_line(error) for error in exc.errors()] + unknown) from None
        if unknown:
            raise SpecError(unknown)
        return spec

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        """A spec.json, written with sections or (before them) flat."""
        return cls.from_values(json.loads(text))

    def flat(self, mode: str = "python") -> dict[str, Any]:
        """Short name → value for every key: MLflow params, the training key, the DAG's conf."""
        dumped = self.model_dump(mode=mode)
        values = {}
        for key in KEYS:
            node = dumped
            for part in key.path:
                node = node[part]
            values[key.short] = node
        return values

    def problems(self) -> list[str]:
        """Each section's checks, then those across sections; one line each, naming short keys."""
        problems = []
        for name in type(self).model_fields:
            problems += getattr(self, name).problems()
        cluster, training = self.cluster, self.training
        if cluster.strategy == "parameter_server" and not training.shuffle:
            problems.append(
                "shuffle=false is invalid with strategy=parameter_server: expected true (async workers get "
                "distinct batches only by shuffling independently)"
            )
        quantize, formats = self.compression.quantize, self.export.formats
        if quantize != "none" and "tflite" not in formats:
            problems.append(
                f"quantize={quantize} is invalid with export_formats={json.dumps(formats)}: "
                'expected quantize=none, or "tflite" in export_formats (quantized variants are TFLite files)'
            )
        if training.batch_size % cluster.replicas_in_sync:
            problems.append(
                f"batch_size={training.batch_size} is invalid with {cluster.replicas_in_sync} replicas in sync: "
                f"expected a multiple of {cluster.replicas_in_sync} (every replica gets an equal share)"
            )
        weighted, workers = MODEL_WEIGHTED_LAYERS[self.model.architecture], cluster.worker.replicas
        stages = ("workers", workers) if workers > 1 else ("devices_per_worker", cluster.worker_device(0).count)
        if cluster.strategy == "model_parallel" and stages[1] > weighted:
            problems.append(
                f"{stages[0]}={stages[1]} is invalid with strategy=model_parallel and "
                f"model={self.model.architecture}: expected at most {weighted} (the model has {weighted} layers with "
                f"weights; {stages[1]} stages cannot each hold some)"
            )
        if cluster.strategy == "model_parallel" and cluster.micro_batches > training.batch_size:
            problems.append(
                f"micro_batches={cluster.micro_batches} is invalid with batch_size={training.batch_size}: "
                f"expected at most {training.batch_size} (every micro-batch holds at least one example)"
            )
        if (self.data.data_dir or self.data.folder) and not supports(cluster.backend).mounts_host_folders:
            problems.append(
                f"data_dir and dataset=folder:PATH are invalid with backend={cluster.backend}: expected data_dir "
                "empty and a TFDS dataset (its replicas see only the volume holding HETFLOW_HOME)"
            )
        return problems


KEYS: tuple[Key, ...] = tuple(walk(RunSpec))
BY_SHORT = {key.short: key for key in KEYS}
_BY_PATH = {key.dotted: key for key in KEYS}
_SECTIONS = {".".join(key.path[:depth]) for key in KEYS for depth in range(1, len(key.path))}
SPEC_KEYS: tuple[str, ...] = tuple(BY_SHORT)
BACKEND_ONLY_KEYS: tuple[str, ...] = tuple(key.short for key in KEYS if key.backends)


def flat_values(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` keyed by short names, whether given by short name, path or section (a flat
    spec.json of old and a nested one read alike); keys of neither kind stay as they were given."""
    flat: dict[str, Any] = {}
    _flatten(values, "", flat)
    return flat


def _flatten(values: dict[str, Any], prefix: str, into: dict[str, Any]) -> None:
    for name, value in values.items():
        path = f"{prefix}{name}"
        if path in _SECTIONS and isinstance(value, dict):
            _flatten(value, f"{path}.", into)
            continue
        key = _BY_PATH.get(path) or (None if prefix else BY_SHORT.get(path))
        into[key.short if key else path] = value


def _error_line(error: dict[str, Any]) -> str:
    """A pydantic error, whose location is a path, told by the key's short name."""
    location = tuple(error["loc"])
    for depth in range(len(location), 0, -1):
        key = _BY_PATH.get(".".join(str(part) for part in location[:depth]))
        if key is not None:
            return invalid_line(error, key, location[depth:])
    return invalid_line(error, None, ())


def parse_spec(values: dict[str, Any]) -> RunSpec:
    """Validate ``values`` (missing keys take defaults); raise SpecError listing every problem."""
    spec = RunSpec.from_values(values)
    problems = spec.problems()
    if problems:
        raise SpecError(problems)
    return spec

"""TFLite metadata on every TFLite file hetflow writes: the model's name and version, the input's
normalization, the label names as an associated file (``labels.txt``), for the ``serving_default``
signature the converter names.

Written the way TFLite Support's ``MetadataPopulator`` writes it (tensorflow/tflite-support,
``metadata_schema.fbs``, schema 1.5.0, vendored as tests/schemas/tflite_metadata_schema.fbs): a
``ModelMetadata`` flatbuffer (file identifier ``M001``) in a buffer of the model that the model's
metadata entry ``TFLITE_METADATA`` names, and the associated files appended to the model file as a
zip archive, which LiteRT does not read past the flatbuffer. tflite-support itself cannot be installed
beside protobuf 7 (it needs protobuf<4), and Python generated from the schema would be thousands of
lines: the few tables written here are built field by field with the flatbuffers runtime, their
slots in the schema's order (a union takes two: its type, then its value); the tests decode them
with flatc, Google's own reader of the schema.

The version a file is registered as is known only when register creates it: compress and export write
``UNREGISTERED``, and register writes its copy with the version number (``with_version``).
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass, replace
from typing import Any

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema
from flatbuffers import number_types
from flatbuffers.table import Table

METADATA_NAME = "TFLITE_METADATA"
METADATA_IDENTIFIER, MODEL_IDENTIFIER = b"M001", b"TFL3"
LABELS_FILE = "labels.txt"
UNREGISTERED = "unregistered"
SIGNATURE = "serving_default"
MIN_PARSER_VERSION = "1.0.0"  # every table and field written here is in the schema's first version
# The schema's enum values: AssociatedFileType, ColorSpaceType, ContentProperties, ProcessUnitOptions.
_TENSOR_AXIS_LABELS = 2
_COLOR_SPACES = {1: 2, 3: 1}  # channels -> GRAYSCALE, RGB
_FEATURE_PROPERTIES, _IMAGE_PROPERTIES, _NORMALIZATION = 1, 2, 1
# A fixed time for the zip's entries, so that the same metadata gives the same bytes (and sha256).
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


class MetadataError(ValueError):
    """A TFLite file without hetflow's metadata, or with metadata it cannot read."""


@dataclass(frozen=True)
class EdgeMetadata:
    """What a TFLite file says about itself; the input's normalization is the model's own, applied
    inside it: ``(pixel - mean) / std`` (a client feeds raw uint8 pixels)."""

    name: str
    version: str
    description: str
    input_name: str
    output_name: str
    image_shape: tuple[int, int, int]  # height, width, channels
    mean: tuple[float, ...]
    std: tuple[float, ...]
    labels: tuple[str, ...]


def model_normalization(model: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean and std of the normalization ``model`` applies to its input, read from its Rescaling
    layer (``x * scale + offset`` is ``(x - mean) / std`` with std = 1/scale, mean = -offset/scale);
    (0,), (1,) where it has none."""
    import tensorflow as tf

    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.Rescaling):
            scale = np.atleast_1d(np.asarray(layer.scale, dtype=np.float64))
            offset = np.broadcast_to(np.asarray(layer.offset, dtype=np.float64), scale.shape)
            # + 0.0: a zero offset gives mean 0.0, not -0.0
            return tuple(float(m) + 0.0 for m in -offset / scale), tuple(float(s) for s in 1.0 / scale)
    return (0.0,), (1.0,)


def variant_metadata(model: Any, spec: Any, dataset: Any, variant: str) -> EdgeMetadata:
    """The metadata of ``model``'s TFLite file ``variant`` in a run of ``spec`` (a ``RunSpec``) on
    ``dataset`` (a ``DatasetRecord``), named as register names the TFLite model, not yet registered."""
    mean, std = model_normalization(model)
    return EdgeMetadata(
        name=f"{spec.registry.model_name}-tflite",
        version=UNREGISTERED,
        description=(
            f"hetflow {spec.model.architecture} trained on {dataset.name} {dataset.version} "
            f"(fingerprint {dataset.fingerprint}), TFLite variant {variant}"
        ),
        input_name=model.input_names[0],
        output_name=model.output_names[0],
        image_shape=tuple(int(d) for d in model.input_shape[1:]),
        mean=mean,
        std=std,
        labels=tuple(dataset.class_names),
    )


def with_metadata(model_file: bytes, metadata: EdgeMetadata) -> bytes:
    """``model_file`` (any metadata of ours and associated files it had replaced) carrying ``metadata``
    in its ``TFLITE_METADATA`` buffer, ``labels.txt`` appended as a zip."""
    model = schema.ModelT.InitFromPackedBuf(model_file, 0)
    _check_signature(model, metadata)
    buffer = schema.BufferT()
    buffer.data = np.frombuffer(_metadata_flatbuffer(metadata), dtype=np.uint8)
    entry = next((m for m in model.metadata or [] if m.name.decode() == METADATA_NAME), None)
    if entry is None:
        entry = schema.MetadataT()
        entry.name, entry.buffer = METADATA_NAME, len(model.buffers)
        model.buffers.append(buffer)
        model.metadata = [*(model.metadata or []), entry]
    else:
        model.buffers[entry.buffer] = buffer
    builder = flatbuffers.Builder(len(model_file) + 4096)
    builder.Finish(model.Pack(builder), MODEL_IDENTIFIER)
    packed = io.BytesIO(bytes(builder.Output()))
    packed.seek(0, io.SEEK_END)
    with zipfile.ZipFile(packed, "a") as archive:  # appended after the flatbuffer, as the populator does
        archive.writestr(zipfile.ZipInfo(LABELS_FILE, _ZIP_TIME), "".join(f"{label}\n" for label in metadata.labels))
    return packed.getvalue()


def _check_signature(model: Any, metadata: EdgeMetadata) -> None:
    """The metadata describes the converter's ``serving_default`` signature: its one input and output by name."""
    names = {
        signature.signatureKey.decode(): (
            [t.name.decode() for t in signature.inputs],
            [t.name.decode() for t in signature.outputs],
        )
        for signature in model.signatureDefs or []
    }
    wanted = ([metadata.input_name], [metadata.output_name])
    if names.get(SIGNATURE) != wanted:
        raise MetadataError(
            f"the TFLite file's signatures are {names}: expected {SIGNATURE} with inputs/outputs {wanted}"
        )


def with_version(model_file: bytes, version: str) -> bytes:
    """``model_file``'s metadata with ``version`` in place of the one it says."""
    return with_metadata(model_file, replace(read_metadata(model_file), version=version))


def read_metadata(model_file: bytes) -> EdgeMetadata:
    """The metadata ``with_metadata`` wrote into ``model_file``."""
    model = schema.ModelT.InitFromPackedBuf(model_file, 0)
    entry = next((m for m in model.metadata or [] if m.name.decode() == METADATA_NAME), None)
    if entry is None:
        raise MetadataError(f"the TFLite file has no {METADATA_NAME} metadata")
    data = bytes(np.asarray(model.buffers[entry.buffer].data, dtype=np.uint8))
    if data[4:8] != METADATA_IDENTIFIER:
        raise MetadataError(f"the {METADATA_NAME} buffer is not a ModelMetadata flatbuffer ({data[4:8]!r})")
    root = Table(data, number_types.UOffsetTFlags.py_type(int.from_bytes(data[:4], "little")))
    subgraph = _tables(root, 3)[0]
    image, logits = _tables(subgraph, 2)[0], _tables(subgraph, 3)[0]
    size = _table(_table(_table(image, 3), 1), 1)
    normalization = _table(_tables(image, 4)[0], 1)
    channels = {space: c for c, space in _COLOR_SPACES.items()}[_scalar(_table(_table(image, 3), 1), 0, "int8")]
    return EdgeMetadata(
        name=_string(root, 0),
        version=_string(root, 2),
        description=_string(root, 1),
        input_name=_string(image, 0),
        output_name=_string(logits, 0),
        image_shape=(_scalar(size, 1, "uint32"), _scalar(size, 0, "uint32"), channels),
        mean=tuple(float(v) for v in _floats(normalization, 0)),
        std=tuple(float(v) for v in _floats(normalization, 1)),
        labels=tuple(associated_file(model_file, LABELS_FILE).decode().splitlines()),
    )


def associated_file(model_file: bytes, name: str) -> bytes:
    """An associated file packed in ``model_file``'s zip."""
    try:
        with zipfile.ZipFile(io.BytesIO(model_file)) as archive:
            return archive.read(name)
    except (zipfile.BadZipFile, KeyError) as error:
        raise MetadataError(f"the TFLite file packs no {name}: {error}") from error


def summary(metadata: EdgeMetadata) -> dict[str, Any]:
    """The metadata as JSON values: what the edge manifest shows of it."""
    return {
        "name": metadata.name,
        "version": metadata.version,
        "description": metadata.description,
        "signature": {"name": SIGNATURE, "inputs": [metadata.input_name], "outputs": [metadata.output_name]},
        "input": {
            "shape": list(metadata.image_shape),
            "dtype": "uint8",
            "mean": list(metadata.mean),
            "std": list(metadata.std),
        },
        "labels": list(metadata.labels),
        "associated_files": [LABELS_FILE],
    }


# Writing: a table is {slot: value}; a value is a string, a table, a list of tables, float32 values,
# or a scalar (kind, value), kind a flatbuffers number type.


def _metadata_flatbuffer(metadata: EdgeMetadata) -> bytes:
    height, width, channels = metadata.image_shape
    if channels not in _COLOR_SPACES:
        raise MetadataError(f"image channels {channels}: expected one of {', '.join(map(str, _COLOR_SPACES))}")
    image = {
        0: metadata.input_name,
        1: "Raw pixels, uint8 0-255; the model normalizes them itself as (pixel - mean) / std (process_units).",
        3: {
            0: ("uint8", _IMAGE_PROPERTIES),
            1: {0: ("int8", _COLOR_SPACES[channels]), 1: {0: ("uint32", width), 1: ("uint32", height)}},
        },
        4: [{0: ("uint8", _NORMALIZATION), 1: {0: np.float32(metadata.mean), 1: np.float32(metadata.std)}}],
        5: {0: np.float32([255.0] * channels), 1: np.float32([0.0] * channels)},
    }
    logits = {
        0: metadata.output_name,
        1: f"Logits, one per class of {LABELS_FILE} (softmax gives probabilities).",
        3: {0: ("uint8", _FEATURE_PROPERTIES), 1: {}},
        6: [
            {
                0: LABELS_FILE,
                1: "The class names, one per line, in the logits' order.",
                2: ("int8", _TENSOR_AXIS_LABELS),
            }
        ],
    }
    root = {
        0: metadata.name,
        1: metadata.description,
        2: metadata.version,
        3: [{0: SIGNATURE, 2: [image], 3: [logits]}],
        4: "hetflow",
        7: MIN_PARSER_VERSION,
    }
    builder = flatbuffers.Builder(1024)
    builder.Finish(_build(builder, root), METADATA_IDENTIFIER)
    return bytes(builder.Output())


def _build(builder: flatbuffers.Builder, table: dict[int, Any]) -> int:
    """Build ``table``'s children first (a flatbuffer builds a table only after what it points to)."""
    offsets = {slot: _build_value(builder, value) for slot, value in table.items() if not isinstance(value, tuple)}
    builder.StartObject(max(table, default=-1) + 1)
    for slot, value in table.items():
        if isinstance(value, tuple):
            kind, number = value
            getattr(builder, f"Prepend{kind.capitalize()}Slot")(slot, number, 0)
        else:
            builder.PrependUOffsetTRelativeSlot(slot, offsets[slot], 0)
    return builder.EndObject()


def _build_value(builder: flatbuffers.Builder, value: Any) -> int:
    if isinstance(value, str):
        return builder.CreateString(value)
    if isinstance(value, np.ndarray):
        return builder.CreateNumpyVector(value)
    if isinstance(value, dict):
        return _build(builder, value)
    children = [_build(builder, child) for child in value]
    builder.StartVector(4, len(children), 4)
    for child in reversed(children):
        builder.PrependUOffsetTRelative(child)
    return builder.EndVector()


# Reading: a field's slot in the table's vtable.


def _offset(table: Table, slot: int) -> int:
    return table.Offset(4 + 2 * slot)


def _string(table: Table, slot: int) -> str:
    offset = _offset(table, slot)
    return table.String(table.Pos + offset).decode() if offset else ""


def _table(table: Table, slot: int) -> Table:
    offset = _offset(table, slot)
    if not offset:
        raise MetadataError(f"metadata table field {slot} is missing")
    return Table(table.Bytes, table.Indirect(table.Pos + offset))


def _tables(table: Table, slot: int) -> list[Table]:
    offset = _offset(table, slot)
    if not offset:
        raise MetadataError(f"metadata vector field {slot} is missing")
    start = table.Vector(offset)
    return [Table(table.Bytes, table.Indirect(start + 4 * i)) for i in range(table.VectorLen(offset))]


def _floats(table: Table, slot: int) -> np.ndarray:
    offset = _offset(table, slot)
    return np.frombuffer(table.Bytes, "<f4", table.VectorLen(offset), table.Vector(offset)) if offset else np.zeros(0)


def _scalar(table: Table, slot: int, kind: str) -> int:
    flags = getattr(number_types, f"{kind.capitalize()}Flags")
    offset = _offset(table, slot)
    return int(table.Get(flags, table.Pos + offset)) if offset else 0

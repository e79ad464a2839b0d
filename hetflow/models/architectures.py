"""Models. Each takes raw uint8 pixels (scaling lives inside the model, so an exported model needs
no preprocessing) and outputs logits, trained with a from-logits loss.

Every model is a chain of layers, so it can also be split into consecutive layer groups placed on
different devices (model parallelism).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import tensorflow as tf

from hetflow.models.stage_split import split_by_parameters
from hetflow.records import DatasetRecord

if TYPE_CHECKING:
    from hetflow.spec import RunSpec

MODELS = ("mlp", "cnn", "convnet", "wide_mlp", "deep_mlp")
WIDE_UNITS = 4096
DEEP_UNITS, DEEP_LAYERS = 1024, 12
# tf_keras reads and writes a file so named as plain arrays keyed by layer class and order.
WEIGHTS_SUFFIX = ".weights.h5"


class WeightsError(ValueError):
    """A file that is not a weights file for the model it is read into."""


def layer_chain(kind: str, num_classes: int) -> list[tf.keras.layers.Layer]:
    layers = tf.keras.layers
    chain: list[tf.keras.layers.Layer] = [layers.Rescaling(1.0 / 255.0)]
    if kind == "mlp":
        chain += [layers.Flatten(), layers.Dense(128, activation="relu")]
    elif kind == "cnn":
        chain += [
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.GlobalAveragePooling2D(),
            layers.Dense(64, activation="relu"),
        ]
    elif kind == "convnet":
        # The benchmark model (bench/RESULTS.md): ~1.1 M parameters on 32x32x3, enough compute
        # per step that multi-worker all-reduce can hide behind it.
        for filters in (32, 64):
            chain += [
                layers.Conv2D(filters, 3, padding="same", activation="relu"),
                layers.Conv2D(filters, 3, padding="same", activation="relu"),
                layers.MaxPooling2D(),
            ]
        chain += [layers.Flatten(), layers.Dense(256, activation="relu")]
    elif kind == "wide_mlp":
        # Too big for a small replica (model parallelism's reason to exist): four 4096x4096 layers
        # hold 67 M parameters, 270 MB, and Adam's slots and the gradients make it 1.1 GB.
        chain += [layers.Flatten(), *(layers.Dense(WIDE_UNITS, activation="relu") for _ in range(5))]
    elif kind == "deep_mlp":
        # Many layers of one size (after the first, which also reads the image): a model_parallel split
        # can give each stage nearly any share of the work, which one cut of a few unequal layers cannot.
        chain += [layers.Flatten(), *(layers.Dense(DEEP_UNITS, activation="relu") for _ in range(DEEP_LAYERS))]
    else:
        raise ValueError(f"model={kind!r} is invalid: expected one of {', '.join(MODELS)}")
    return chain + [layers.Dense(num_classes, name="logits")]


def _connect(kind: str, input_shape: list[int], groups: list[tuple[str | None, list]]) -> tf.keras.Model:
    pixels = tf.keras.Input(shape=input_shape, dtype=tf.uint8, name="image")
    x = pixels
    for device, layers in groups:
        with tf.device(device):  # variables are created where their layer group runs
            for layer in layers:
                x = layer(x)
    return tf.keras.Model(pixels, x, name=kind)


def build_model(kind: str, input_shape: list[int], num_classes: int, seed: int) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(seed)
    return _connect(kind, input_shape, [(None, layer_chain(kind, num_classes))])


def _arrays(path: Path) -> dict[str, tuple]:
    """Each array of an HDF5 file by name: (shape, dtype). Only hard links are visited (a soft or
    external link names something else); an array whose bytes live in another file is refused."""
    found = {}

    def visit(name: str, item: Any) -> None:
        if isinstance(item, h5py.Dataset):
            if item.external or item.is_virtual:
                raise WeightsError(f"array {name} reads its data from another file")
            found[name] = (item.shape, item.dtype.str)

    with h5py.File(path, "r") as file:
        file.visititems(visit)
    return found


def _layout_difference(found: dict[str, tuple], expected: dict[str, tuple]) -> str:
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    changed = sorted(name for name in expected.keys() & found.keys() if found[name] != expected[name])
    parts = [f"{len(missing)} array(s) missing, e.g. {missing[0]}"] if missing else []
    parts += [f"{len(unexpected)} unexpected array(s), e.g. {unexpected[0]}"] if unexpected else []
    parts += [f"{changed[0]} is {found[changed[0]]}, expected {expected[changed[0]]}"] if changed else []
    return "; ".join(parts)


def _private_copy(path: Path, directory: Path) -> Path:
    """The bytes ``path`` holds when opened, copied once into ``directory`` (the pipeline's own): the
    copy is what is checked and loaded, so a file renamed in at ``path`` after the check, or written
    through it, is never read. Opened without following a link; a name that is not a regular file
    is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        reasons = {errno.ELOOP: "a symbolic link", errno.ENOENT: "no such file"}
        raise WeightsError(reasons.get(error.errno, error.strerror)) from None
    copy = directory / f"checked{WEIGHTS_SUFFIX}"  # tf_keras picks the HDF5 format by this suffix
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise WeightsError("not a regular file")
        target = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            # Only the size it had when opened: a writer still appending cannot keep the copy going.
            copied = 0
            while copied < status.st_size:
                sent = os.sendfile(target, fd, copied, status.st_size - copied)
                if not sent:
                    break
                copied += sent
        finally:
            os.close(target)
    finally:
        os.close(fd)
    return copy


def read_weights(model: tf.keras.Model, path: Path) -> tf.keras.Model:
    """Read only the weights at ``path`` into ``model``, an architecture built here from code.

    ``tf.keras.models.load_model`` would build whatever the file describes, and on tf_keras's HDF5
    path (any file that is not a Keras zip) safe_mode does not apply: a Lambda layer's bytecode
    runs. So the file must hold exactly the arrays ``model.save_weights`` writes for this
    architecture, of the same shapes and dtypes; anything else raises a one-line WeightsError
    naming the file. Its writer (a replica) may still be running, so the file is opened once and
    copied privately, and the same bytes are checked and loaded.
    """
    path = Path(path)
    try:
        if not path.name.endswith(WEIGHTS_SUFFIX):
            raise WeightsError(f"not an HDF5 weights file (*{WEIGHTS_SUFFIX})")
        # A directory of the pipeline's alone (0700): nobody else can swap the copy.
        with tempfile.TemporaryDirectory() as scratch:
            checked = _private_copy(path, Path(scratch))
            if not h5py.is_hdf5(checked):
                raise WeightsError(f"not an HDF5 weights file (*{WEIGHTS_SUFFIX})")
            reference = Path(scratch) / f"reference{WEIGHTS_SUFFIX}"
            model.save_weights(reference)
            difference = _layout_difference(_arrays(checked), _arrays(reference))
            if difference:
                raise WeightsError(difference)
            model.load_weights(checked)
    except (WeightsError, OSError) as error:  # h5py raises OSError on a damaged or truncated file
        reason = (str(error) or type(error).__name__).splitlines()[0]
        raise WeightsError(f"refusing {path} as the weights of the {model.name} model: {reason}") from None
    return model


def trained_model(spec: RunSpec, dataset: DatasetRecord, path: Path) -> tf.keras.Model:
    """The run's architecture rebuilt from its spec, with the trained weights read from ``path``."""
    return read_weights(
        build_model(spec.model.architecture, dataset.input_shape, dataset.num_classes, spec.training.seed), path
    )


def build_model_parallel(
    kind: str,
    input_shape: list[int],
    num_classes: int,
    seed: int,
    devices: list[str],
    bounds: list[int] | None = None,
) -> tuple[tf.keras.Model, list[tuple[str, list[tf.keras.layers.Layer]]]]:
    """The model split into ``len(devices)`` consecutive layer groups at ``bounds`` (each group's
    first layer index after the first group; default: about equal parameter count), each group's
    variables on its device. Same weights as ``build_model`` with this seed."""
    if bounds is None:
        counts = [layer.count_params() for layer in build_model(kind, input_shape, num_classes, seed).layers[1:]]
        bounds = split_by_parameters(counts, len(devices))
    tf.keras.utils.set_random_seed(seed)
    chain = layer_chain(kind, num_classes)
    starts, ends = [0, *bounds], [*bounds, len(chain)]
    groups = [(device, chain[start:end]) for device, start, end in zip(devices, starts, ends)]
    return _connect(kind, input_shape, groups), groups


def compile_model(model: tf.keras.Model, optimizer: tf.keras.optimizers.Optimizer) -> None:
    model.compile(
        optimizer=optimizer,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )

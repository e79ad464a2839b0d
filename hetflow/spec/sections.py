"""The spec's sections besides the cluster: data, model, training, compression, export, registry.

Each section is a frozen model of its own fields and holds the checks that need only those
fields (``problems``); checks across sections are RunSpec's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from hetflow.spec.data_roots import DATA_ROOTS_ENV, data_roots, under_a_root


def spec_field(
    default: Any, description: str, *, title: str, short: str | None = None, backends: tuple[str, ...] = (), **limits
) -> Any:
    """A leaf of the spec. ``title`` is written for people: the trigger form labels the field with it.
    ``short`` is the key people type (``--set``, ``--config``, the form, conf, MLflow params) where it
    is not the field's own name; ``backends`` names the only backends that read the field."""
    extra: dict[str, Any] = {"short": short} if short else {}
    if backends:
        extra["backends"] = list(backends)
    return Field(default, description=description, title=title, json_schema_extra=extra, **limits)


def field_backends(field: Any) -> list[str]:
    """The backends that read a field; empty: every backend."""
    return (field.json_schema_extra or {}).get("backends", [])


def short_name(name: str, field: Any) -> str:
    """The key people type for the field ``name``."""
    return (field.json_schema_extra or {}).get("short", name)


class SpecModel(BaseModel):
    """What every part of the spec checks, a section or an element of a list (worker_devices)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # Pydantic reads true and false as 1 and 0 where a number is expected: epochs=true would
        # train one epoch, which no one who typed it meant.
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and bool not in (annotation, *get_args(annotation)):
            raise PydanticCustomError("bool_for_number", "expected a number, not true or false")
        return value


class Section(SpecModel):
    @field_validator("*", mode="before")
    @classmethod
    def _empty_takes_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        # The form leaves fields of other backends optional and sends a cleared one as null, which
        # means the field's default: with backend=local nobody has to fill in a Kubernetes namespace.
        field = cls.model_fields[info.field_name]
        return field.default if value is None and field_backends(field) else value

    def problems(self) -> list[str]:
        """What is wrong across this section's fields, one line each, naming the short keys."""
        return []


class DataSpec(Section):
    model_config = ConfigDict(title="Data")

    dataset: str = spec_field(
        "uci_digits",
        "A TFDS dataset name, optionally with a version (`mnist:3.0.1`), or `folder:/ABSOLUTE/PATH`: your own images, "
        "one sub-folder per class (optionally under `train/` and `test/`), in HETFLOW_HOME/data or under a root "
        "the machine's operator allows (HETFLOW_DATA_ROOTS). `uci_digits` is built offline from "
        "the UCI optical digits shipped with scikit-learn; other TFDS names are downloaded into data_dir "
        "when not prepared there.",
        pattern=r"^([a-z][a-z0-9_]*(/[a-z0-9_][a-z0-9_.]*)?(:[0-9]+\.[0-9]+\.[0-9]+)?|folder:/[^\x00]+)$",
        title="Dataset",
    )
    data_dir: str | None = spec_field(
        None,
        "Where TFDS datasets (and prepared image folders) are read and prepared; empty: HETFLOW_HOME/data, "
        "shared by all runs. Elsewhere only under a root the machine's operator allows (HETFLOW_DATA_ROOTS).",
        pattern=r"^(/[^\x00]*)?$",
        title="Data directory",
    )
    image_size: str | None = spec_field(
        None,
        "dataset=folder:...: resize every image to HEIGHTxWIDTH (e.g. `28x28`); empty: the images' own size, "
        "which must then be the same for all.",
        pattern=r"^([1-9][0-9]{0,3}x[1-9][0-9]{0,3})?$",
        title="Image size (folder datasets)",
    )
    skip_unchanged: bool = spec_field(
        True,
        "Skip training and register nothing when a version of registered_model was already trained from this "
        "exact spec on data with the same fingerprint.",
        title="Skip when already trained",
    )

    @property
    def folder(self) -> str | None:
        """dataset=folder:PATH: the PATH; None for a TFDS dataset."""
        return self.dataset.removeprefix("folder:") if self.dataset.startswith("folder:") else None

    def problems(self) -> list[str]:
        problems = []
        if self.image_size and not self.folder:
            problems.append(
                f"image_size={self.image_size} is invalid with dataset={self.dataset}: expected empty "
                "(images are resized only for dataset=folder:PATH)"
            )
        return problems + data_location_problems(self)


def data_location_problems(data: DataSpec) -> list[str]:
    """data_dir and dataset=folder:PATH outside the allowed roots (``data_roots``), links resolved:
    checked when the spec is validated, and again by prepare_data right before it reads them."""
    problems = []
    if data.data_dir and not under_a_root(data.data_dir, data_roots()):
        problems.append(
            f"data_dir={data.data_dir} is invalid: expected empty or a folder under {', '.join(data_roots())} "
            f"(every replica is shown it; the machine's operator may allow more roots in {DATA_ROOTS_ENV})"
        )
    if data.folder and not under_a_root(data.folder, data_roots()):
        problems.append(
            f"dataset={data.dataset} is invalid: expected a TFDS name or folder:PATH with PATH under "
            f"{', '.join(data_roots())} (the machine's operator may allow more roots in {DATA_ROOTS_ENV})"
        )
    return problems


# The layers with weights of each model (``hetflow.models.architectures.layer_chain``): model_parallel's
# most stages, each holding some of the model's variables.
MODEL_WEIGHTED_LAYERS = {"mlp": 2, "cnn": 4, "convnet": 6, "wide_mlp": 6, "deep_mlp": 13}


class ModelSpec(Section):
    model_config = ConfigDict(title="Model")

    architecture: Literal["mlp", "cnn", "convnet", "wide_mlp", "deep_mlp"] = spec_field(
        "mlp",
        "`mlp`: flatten, dense 128 relu, dense logits. `cnn`: two conv blocks and a dense head. "
        "`convnet`: the benchmark CNN (conv32-conv32-pool-conv64-conv64-pool-dense256), for 32x32 images. "
        "`wide_mlp`: flatten, five dense 4096 relu, dense logits (67 M parameters: 270 MB of weights, about "
        "1.1 GB with gradients and Adam's slots), a model for model_parallel on replicas too small to hold it. "
        "`deep_mlp`: flatten, twelve dense 1024 relu, dense logits (15 M parameters): layers of one size, which "
        "model_parallel can split over unequal workers in nearly any proportion.",
        short="model",
        title="Model",
    )


# The training shuffle's bound: above any split hetflow trained on before it existed (the digits'
# 1,257 training examples), so those are still shuffled as one buffer the size of the split.
SHUFFLE_BUFFER = 10_000
# The most of a training split a worker caches in memory, in MB of decoded examples.
CACHE_BUDGET_MB = 512


class TrainingSpec(Section):
    model_config = ConfigDict(title="Training")

    epochs: int = spec_field(40, "Passes over the training split.", ge=1, le=1000, title="Epochs")
    steps_per_epoch: int | None = spec_field(
        None,
        "Steps per epoch; empty means one full pass over the training split.",
        ge=1,
        le=100_000,
        title="Steps per epoch",
    )
    batch_size: int = spec_field(
        32, "Global batch size, summed over all replicas.", ge=1, le=65_536, title="Batch size (global)"
    )
    learning_rate: float = spec_field(0.001, "Base learning rate.", gt=0, le=10, title="Learning rate")
    target_accuracy: float | None = spec_field(
        None,
        "Stop training at the end of the first epoch whose validation accuracy reaches this (the time to "
        "reach it is logged); empty trains all epochs.",
        gt=0,
        le=1,
        title="Stop at validation accuracy",
    )
    lr_scaling: Literal["none", "linear"] = spec_field(
        "none",
        "`linear`: the linear scaling rule (Goyal et al. 2017): the rate is learning_rate x batch_size / "
        "lr_reference_batch, reached after warmup_epochs. batch_size is the global batch (async: each "
        "update's), so adding replicas at the same batch_size leaves the rate unchanged.",
        title="Learning-rate scaling",
    )
    lr_reference_batch: int = spec_field(
        32,
        "The global batch size learning_rate was tuned for: the batch of the linear scaling rule's ratio "
        "(lr_scaling=linear).",
        ge=1,
        le=65_536,
        title="Reference batch size",
    )
    warmup_epochs: float = spec_field(
        0.0,
        "Epochs over which the learning rate ramps linearly up to its scaled value.",
        ge=0,
        le=100,
        title="Warm-up epochs",
    )
    optimizer: Literal["sgd", "adam"] = spec_field("adam", "Optimizer.", title="Optimizer")
    shuffle: bool = spec_field(True, "Shuffle training examples every epoch.", title="Shuffle")
    shuffle_buffer: int = spec_field(
        SHUFFLE_BUFFER,
        "Examples the training shuffle holds at once: the whole training split where it has fewer (a "
        "uniform shuffle), otherwise this many, drawn from as the split streams past. Bounds the "
        "shuffle's memory whatever the split's size.",
        ge=1,
        le=1_000_000,
        title="Shuffle buffer (examples)",
    )
    cache_budget_mb: int = spec_field(
        CACHE_BUDGET_MB,
        "A training split whose decoded examples fit this many MB is cached in memory, and sync workers "
        "each hold it whole and take their exact shares of one shuffled order (N workers train as one "
        "would); a larger split streams from its files every epoch, each sync worker reading only the "
        "files of its own share. Parameter-server workers always read only their own part of the split, "
        "cached where the part fits; a replica's validation split is cached only where it fits. "
        "training.json's training_input and validation_input say which.",
        ge=0,
        le=1_000_000,
        title="Cache budget (MB)",
    )
    seed: int = spec_field(42, "Seed for weights, shuffling and ops.", ge=0, le=2**31 - 1, title="Random seed")
    checkpoint_every: int = spec_field(
        1,
        "Save a checkpoint every this many epochs (model, optimizer, epoch); a restarted or retried run "
        "resumes from the last one.",
        ge=1,
        le=1000,
        title="Checkpoint every (epochs)",
    )


# TFLite's advice for the int8 representative dataset: "a small subset (around ~100-500 samples) of the
# training or validation data" (post_training_quantization.md); 200 is the sample compress always drew.
CALIBRATION_EXAMPLES = 200


class CompressionSpec(Section):
    model_config = ConfigDict(title="Compression")

    prune: bool = spec_field(
        True, "Magnitude-prune the trained model (fine-tuned with a polynomial-decay schedule).", title="Prune"
    )
    target_sparsity: float = spec_field(
        0.5, "Fraction of each kernel's weights set to zero by pruning.", ge=0, lt=1, title="Target sparsity"
    )
    fine_tuning_share: float = spec_field(
        1.5,
        "Longest pruning fine-tuning, as a share of the optimizer steps training took (at least 200 steps): "
        "sparsity ramps up over 0.375 of them, then the recovery at target_sparsity stops as soon as "
        "validation accuracy is back within half of max_accuracy_drop of the float model's, or stops improving.",
        ge=0.5,
        le=4,
        title="Longest pruning fine-tuning (share of training steps)",
    )
    quantize: Literal["none", "dynamic", "float16", "int8"] = spec_field(
        "int8",
        "Quantization of the TFLite variants: `dynamic` (int8 weights), `float16`, `int8` (full integer, "
        "calibrated on the train split; where that loses more than max_accuracy_drop on the validation split, "
        "quantization-aware fine-tuning that keeps the pruned zeros), or `none`.",
        title="Quantization",
    )
    calibration_examples: int = spec_field(
        CALIBRATION_EXAMPLES,
        "Training examples the int8 quantization is calibrated on (its activation ranges), drawn at random "
        "with the seed and read in one pass: only they are held, whatever the split's size. TFLite advises "
        "about 100-500.",
        ge=10,
        le=10_000,
        title="int8 calibration examples",
    )


class ExportSpec(Section):
    model_config = ConfigDict(title="Export")

    max_accuracy_drop: float = spec_field(
        0.01,
        "A compressed variant whose test accuracy is more than this below the float model's is rejected.",
        ge=0,
        le=1,
        title="Largest accuracy drop allowed",
    )
    formats: list[Literal["saved_model", "tflite"]] = spec_field(
        ["saved_model", "tflite"],
        "What export writes: a SavedModel (serving_default takes raw uint8 images) and/or TFLite variants.",
        short="export_formats",
        min_length=1,
        title="Export formats",
    )


def model_named_after(dataset: str) -> str:
    """The registered model a run on ``dataset`` registers into when the spec names none."""
    if dataset == "uci_digits":
        return "hetflow-digits"  # the name of every run before the default followed the data
    name = Path(dataset.removeprefix("folder:")).name if dataset.startswith("folder:") else dataset.split(":")[0]
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-.") or "folder"
    return f"hetflow-{slug}"[:100]


class RegistrySpec(Section):
    model_config = ConfigDict(title="Registry")

    model_name: str | None = spec_field(
        None,
        "MLflow registered model name (its TFLite model adds `-tflite`). Empty: named after the dataset, "
        "`hetflow-digits` for uci_digits, `hetflow-NAME` for a TFDS dataset NAME or an image folder .../NAME, so "
        "that models of different data do not share a champion.",
        short="registered_model",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        title="Registered model",
    )
    min_improvement: float = spec_field(
        0.001,
        "The new version becomes `champion` only if its test accuracy beats the champion's by at least this.",
        ge=0,
        le=1,
        title="Smallest improvement for champion",
    )

"""The records one stage hands the next, as typed models: written and read only through
``StageRecord.write`` and ``StageRecord.read``, at the path ``RunPaths`` gives each (``FILE``), so no
stage reads another's record by string key. ``RunSpec`` (spec.json) is the first of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from hetflow.paths import NotRegularFile, RunPaths, read_replica_record, write_record

Record = TypeVar("Record", bound="StageRecord")


class StageRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    FILE: ClassVar[str]  # the RunPaths attribute naming its file
    # Whether the file holds only the fields the record was given: where a case has no such key
    # (compression.json without pruning), the file leaves it out rather than writing null.
    ONLY_GIVEN: ClassVar[bool] = False

    @classmethod
    def read(cls: type[Record], paths: RunPaths) -> Record:
        """Read as data (``read_replica_record``: a regular file, bounded), then checked."""
        return cls.model_validate(read_replica_record(getattr(paths, cls.FILE)))

    def write(self, paths: RunPaths) -> None:
        write_record(getattr(paths, self.FILE), self.as_json())

    def as_json(self) -> dict[str, Any]:
        """The record as JSON values: what a stage returns to Airflow."""
        return self.model_dump(mode="json", exclude_unset=self.ONLY_GIVEN)


class _Part(BaseModel):
    """A record's nested part, checked as strictly as the record."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainedBefore(_Part):
    """The registered version another Airflow run trained from the same spec on the same data."""

    model_name: str
    version: int
    mlflow_run_id: str | None  # None: a version registered from no run
    airflow_run_id: str | None
    aliases: list[str]


class DatasetRecord(StageRecord):
    """prepare_data's record (dataset.json): the prepared dataset every later stage and every
    replica reads, and whether this training was done before."""

    FILE = "dataset"

    name: str
    version: str
    data_dir: str
    prepared_dir: str
    source_path: str  # what the data was prepared from: the image folder, or TFDS's prepared copy
    reused: bool
    splits: dict[str, int]  # examples per split
    shards: dict[str, int]
    input_shape: list[int]
    num_classes: int
    class_names: list[str]
    fingerprint: str
    data_changed: bool  # it replaced another fingerprint of this dataset: new data
    training_key: str = ""  # the spec and data this training is for (hetflow.registry.training_key)
    trained_before: TrainedBefore | None = None
    skip_reason: str | None = None  # why the rest of the run skips, where it was trained before


class EvaluationRecord(StageRecord):
    """evaluate's record (evaluation.json): the trained model on the test split."""

    FILE = "evaluation"

    test_loss: float
    test_accuracy: float
    test_examples: int
    confusion_matrix: list[list[int]]  # rows: true class, columns: predicted


class FineTuning(_Part):
    """A fine-tuning that stops once validation accuracy recovers (``hetflow.models.fine_tuning``)."""

    steps: int
    max_steps: int
    stopped: Literal["recovered", "stopped_improving", "max_steps"]
    target_validation_accuracy: float
    validation_accuracy: list[tuple[int, float]]  # each round's [step, accuracy]


class SparseTensor(_Part):
    """A tensor the TFLite file stores with sparsity metadata (``hetflow.artifacts.tflite.weight_encoding``)."""

    name: str
    shape: list[int]
    block: list[int] | None  # None: element-wise


class TfliteVariant(_Part):
    """A TFLite file of the float or the pruned model, and how it was made; the int8 choice fields
    are ``hetflow.artifacts.compression.int8_file``'s, the quantization-aware ones only where
    post-training int8 lost too much."""

    path: str
    base: Literal["float", "pruned"]
    quantize: str
    sparsity: float
    encoding: Literal["dense", "sparse"]
    sparse_tensors: list[SparseTensor]
    calibration_examples: int | None = None  # int8: the representative sample's size
    reference_validation_accuracy: float | None = None
    post_training_validation_accuracy: float | None = None
    quantization_aware_steps: int | None = None
    quantization_aware_fine_tuning: FineTuning | None = None
    quantization_aware_seconds: float | None = None
    quantization_aware_validation_accuracy: float | None = None
    int8_method: Literal["post_training", "quantization_aware"] | None = None


class LatencyFigures(_Part):
    p50_ms: float
    p95_ms: float


class LiteRTLatency(_Part):
    """A TFLite file's single-example invoke time in LiteRT by thread count (``hetflow.artifacts.litert_latency``)."""

    invokes: int  # timed, per thread count
    threads: dict[int, LatencyFigures]
    seconds: float  # what measuring took, interpreters' start included


class CompressionRecord(StageRecord):
    """compress's record (compression.json): its TFLite variants by name and, where it pruned
    (``prune``), the pruning's fields (None otherwise, and absent from the file)."""

    FILE = "compression"
    ONLY_GIVEN = True

    prune: bool
    quantize: str
    variants: dict[str, TfliteVariant]
    fine_tuning_seconds: float | None = None
    fine_tuning_steps: int | None = None
    fine_tuning: FineTuning | None = None
    trained_steps: int | None = None
    target_sparsity: float | None = None
    pruned_layers: list[str] | None = None
    pruning_blocks: dict[str, list[int]] | None = None  # per pruned layer
    kernel_sparsity: dict[str, float] | None = None  # per Dense and Conv2D layer
    sparsity: float | None = None  # over all Dense and Conv2D kernels
    pruned_weights: str | None = None
    litert_latency: dict[str, LiteRTLatency] | None = None  # per TFLite variant, the float model's too


class ExportedArtifact(_Part):
    """An exported file scored on the test split and judged (``hetflow.tasks.export``). The TFLite
    fields are None for the SavedModel, and absent from the file."""

    format: Literal["saved_model", "tflite"]
    variant: str | None = None
    quantize: str | None = None
    pruned: bool | None = None
    sparsity: float | None = None
    encoding: Literal["dense", "sparse"] | None = None
    sparse_tensors: list[SparseTensor] | None = None
    int8_method: Literal["post_training", "quantization_aware"] | None = None  # a TFLite file's: null but for int8
    path: str
    weights_bytes: int | None = None  # the SavedModel's variables
    bytes: int
    gzip_bytes: int
    test_accuracy: float
    agreement_with_float: float
    max_logit_difference: float
    latency_ms: float
    max_logit_difference_to_pruned: float | None = None  # the pruned float file's parity
    accuracy_drop: float
    accepted: bool
    reason: str | None = None  # why it was rejected


class ExportRecord(StageRecord):
    """export's record (export.json): every artifact by name, and the TFLite one deployed (None
    when none was accepted)."""

    FILE = "export"
    ONLY_GIVEN = True

    float_test_accuracy: float
    artifacts: dict[str, ExportedArtifact]
    chosen_tflite: str | None


def refused(path: Path, invalid: ValidationError, within: tuple[str, ...] = ()) -> NotRegularFile:
    """A replica's record at ``path`` that its model refused, as one line naming the first field at
    fault, as a dotted path from ``within`` (the part of the file the model checked)."""
    error = invalid.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in (*within, *error["loc"]))
    return NotRegularFile(f"{path}: {where}: {error['msg']}: refused")


class PlanFile(_Part):
    """plan.json, which the chief replica writes in its output folder: what the workers measured
    before their first step (balance_batches, strategy=auto's launch to measure) or model_parallel's
    split. A replica's record: each part is checked by its one reader
    (``hetflow.replica.balance.measured``, ``hetflow.models.stage_split.read_stage_split``), which
    decides again from the numbers."""

    requested: dict[str, Any] | None = None  # the spec the replicas were given (the pipeline keeps its own)
    probes: Any = None  # hetflow.replica.auto_strategy.Probe each, once checked
    worker_batches: Any = None  # each worker's share of the global batch
    stage_split: Any = None  # hetflow.models.stage_split.StageSplitPlan, once checked

    @classmethod
    def read(cls, path: Path) -> PlanFile:
        """Read as data (a regular file, bounded); NotRegularFile, one line, for a key it does not have."""
        try:
            return cls.model_validate(read_replica_record(path))
        except ValidationError as invalid:
            raise refused(path, invalid) from None

    def write(self, path: Path) -> None:
        write_record(path, self.model_dump(mode="json", exclude_none=True))

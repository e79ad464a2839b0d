"""The records one stage hands the next, as typed models: written and read only through
``StageRecord.write`` and ``StageRecord.read``, at the path ``RunPaths`` gives each (``FILE``), so no
stage reads another's record by string key. ``RunSpec`` (spec.json) is the first of them."""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict

from hetflow.paths import RunPaths, read_replica_record, write_record

Record = TypeVar("Record", bound="StageRecord")


class StageRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    FILE: ClassVar[str]  # the RunPaths attribute naming its file

    @classmethod
    def read(cls: type[Record], paths: RunPaths) -> Record:
        """Read as data (``read_replica_record``: a regular file, bounded), then checked."""
        return cls.model_validate(read_replica_record(getattr(paths, cls.FILE)))

    def write(self, paths: RunPaths) -> None:
        write_record(getattr(paths, self.FILE), self.as_json())

    def as_json(self) -> dict[str, Any]:
        """The record as JSON values: what a stage returns to Airflow."""
        return self.model_dump(mode="json")


class TrainedBefore(BaseModel):
    """The registered version another Airflow run trained from the same spec on the same data."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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

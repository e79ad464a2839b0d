"""hetflow.registry.lineage: the prepared dataset as the MLflow dataset input of a run."""

from __future__ import annotations

import json
import warnings

from hetflow.records import DatasetRecord
from hetflow.registry.lineage import dataset_input


def test_the_dataset_source_is_its_local_path_and_resolving_it_warns_of_nothing(tmp_path):
    """register's log said MLflow's source "can be interpreted in multiple ways: LocalArtifactDatasetSource,
    LocalArtifactDatasetSource" on every run."""
    dataset = DatasetRecord.model_construct(
        name="uci_digits", version="1.0.0", fingerprint="ab" * 32, source_path=str(tmp_path), input_shape=[8, 8, 1]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logged = dataset_input(dataset).dataset
    assert (logged.name, logged.source_type, json.loads(logged.source)) == (
        "uci_digits@1.0.0",
        "local",
        {"uri": str(tmp_path)},
    )

"""The training key: what names one training (the requested spec and the data's fingerprint), and the
registered version another run already trained with it (``skip_unchanged``), and why a run skips."""

from __future__ import annotations

import hashlib
import json

from hetflow.records import DatasetRecord, TrainedBefore
from hetflow.spec import RunSpec
from hetflow.spec.cluster import MICRO_BATCHES, STAGE_SPLIT
from hetflow.spec.sections import CACHE_BUDGET_MB, CALIBRATION_EXAMPLES, SHUFFLE_BUFFER
from mlflow import MlflowClient

# Keys added after versions were registered, at their defaults: left out, so that a spec which
# does not set them names the same training as it did before they existed.
ADDED_LATER = {
    "micro_batches": MICRO_BATCHES,
    "stage_split": STAGE_SPLIT,
    "calibration_examples": CALIBRATION_EXAMPLES,
    "shuffle_buffer": SHUFFLE_BUFFER,
    "cache_budget_mb": CACHE_BUDGET_MB,
}


def training_key(spec: RunSpec, fingerprint: str) -> str:
    """Names one training: the requested spec (less the switch that asks whether to repeat it) and
    the fingerprint of the data. Two runs with the same key would train the same model."""
    requested = {
        key: value
        for key, value in spec.flat(mode="json").items()
        if key != "skip_unchanged" and not (key in ADDED_LATER and value == ADDED_LATER[key])
    }
    text = json.dumps({"spec": requested, "data_fingerprint": fingerprint}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


TRAINING_KEY_TAG = "hetflow.training_key"  # on every model version: the training_key it came from


def trained_before(client: MlflowClient, registered_model: str, key: str, airflow_run_id: str) -> TrainedBefore | None:
    """The version of ``registered_model`` that another Airflow run already trained with ``key``, or
    None. This run's own version (a Clear re-runs its stages) does not count."""
    if not client.search_registered_models(f"name = '{registered_model}'"):
        return None
    for version in client.search_model_versions(
        f"name = '{registered_model}' and tags.`{TRAINING_KEY_TAG}` = '{key}'", order_by=["version_number ASC"]
    ):
        if version.tags.get("airflow.run_id") != airflow_run_id:
            return TrainedBefore(
                model_name=registered_model,
                version=int(version.version),
                mlflow_run_id=version.run_id,
                airflow_run_id=version.tags.get("airflow.run_id"),
                aliases=sorted(version.aliases),
            )
    return None


def skip_reason(dataset: DatasetRecord) -> str:
    """Why a run skips, from prepare_data's record of a training done before (``trained_before``)."""
    before = dataset.trained_before
    return (
        f"{before.model_name} v{before.version} was trained from this spec on data with fingerprint "
        f"{dataset.fingerprint[:12]} by Airflow run {before.airflow_run_id}: nothing to train or register "
        "(skip_unchanged=false trains again)"
    )

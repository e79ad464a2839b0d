"""Retraining: which spec ``hetflow_retrain`` trains again — the champion's, with overrides.

Cheap to import (the DAG file imports it at parse time): MLflow is imported inside the function.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from hetflow.paths import read_replica_record
from hetflow.spec import flat_values, parse_spec

log = logging.getLogger("hetflow.retrain")

# The Airflow Asset that stands for "the prepared training data changed": hetflow_train's
# prepare_data emits an event on it when a dataset's fingerprint changes; hetflow_retrain runs on it.
PREPARED_DATA_URI = "hetflow://prepared-data"

# hetflow_retrain's default schedule besides the asset: Sundays 03:00 UTC (HETFLOW_RETRAIN_CRON).
DEFAULT_CRON = "0 3 * * 0"

# What a retrain takes from the champion's recorded spec: its training recipe. Whoever can write to
# the registry writes that record, so where data is read from (data_dir), where replicas run and
# with what (backend, image, Kubernetes, limits, restarts, deadline), which model is promoted and
# the gate's thresholds stay the DAG's defaults and overrides.
FROM_CHAMPION = frozenset(
    {
        "dataset",
        "image_size",
        "model",
        "strategy",
        "workers",
        "ps",
        "devices_per_worker",
        "worker_devices",
        "balance_batches",
        "replica_threads",
        "pin_cores",
        "epochs",
        "steps_per_epoch",
        "batch_size",
        "learning_rate",
        "target_accuracy",
        "lr_scaling",
        "lr_reference_batch",
        "warmup_epochs",
        "optimizer",
        "shuffle",
        "shuffle_buffer",
        "cache_budget_mb",
        "seed",
        "checkpoint_every",
        "prune",
        "target_sparsity",
        "fine_tuning_share",
        "quantize",
        "calibration_examples",
        "export_formats",
    }
)


def retrain_spec(registered_model: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The training recipe of ``registered_model``'s champion (the ``FROM_CHAMPION`` keys of its MLflow
    run's ``run/spec.json``, read as data), the defaults for every other key, ``overrides`` applied,
    validated; the defaults when there is no champion yet."""
    from mlflow.exceptions import MlflowException

    from hetflow.registry import store
    from hetflow.registry.champion import CHAMPION

    client = store.client()
    try:
        champion = client.get_model_version_by_alias(registered_model, CHAMPION)
    except MlflowException:  # no such model, or no champion yet
        champion = None
    if champion is None:
        log.info("%s has no champion: retraining on the defaults", registered_model)
        base = {"registered_model": registered_model}
    else:
        with tempfile.TemporaryDirectory() as folder:
            recorded = read_replica_record(Path(client.download_artifacts(champion.run_id, "run/spec.json", folder)))
        recorded = flat_values(recorded)  # flat before the spec had sections, nested since
        left = sorted(key for key in recorded if key not in FROM_CHAMPION)
        base = {key: value for key, value in recorded.items() if key in FROM_CHAMPION}
        base["registered_model"] = registered_model
        log.info("retraining %s champion v%s (MLflow run %s)", registered_model, champion.version, champion.run_id)
        if left:
            log.info("not taken from the champion's recorded spec (the DAG's to choose): %s", ", ".join(left))
    if overrides:
        log.info("overrides: %s", overrides)
    return parse_spec({**base, **overrides}).flat()

"""Retraining: which spec ``hetflow_retrain`` trains again — the champion's, with overrides.

Cheap to import (the DAG file imports it at parse time): MLflow is imported inside the function.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from tasks.spec import parse_spec

log = logging.getLogger("hetflow.retrain")

# The Airflow Asset that stands for "the prepared training data changed": hetflow_train's
# prepare_data emits an event on it when a dataset's fingerprint changes; hetflow_retrain runs on it.
PREPARED_DATA_URI = "hetflow://prepared-data"

# hetflow_retrain's default schedule besides the asset: Sundays 03:00 UTC (HETFLOW_RETRAIN_CRON).
DEFAULT_CRON = "0 3 * * 0"


def retrain_spec(registered_model: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The spec of ``registered_model``'s champion (from its MLflow run's ``run/spec.json``) with
    ``overrides`` applied, validated; the defaults when there is no champion yet."""
    from mlflow.exceptions import MlflowException

    from mlflow import MlflowClient
    from tasks.registry.champion import CHAMPION
    from tasks.registry.store import tracking_uri

    client = MlflowClient(tracking_uri())
    try:
        champion = client.get_model_version_by_alias(registered_model, CHAMPION)
    except MlflowException:  # no such model, or no champion yet
        champion = None
    if champion is None:
        log.info("%s has no champion: retraining on the defaults", registered_model)
        base = {"registered_model": registered_model}
    else:
        with tempfile.TemporaryDirectory() as folder:
            base = json.loads(Path(client.download_artifacts(champion.run_id, "run/spec.json", folder)).read_text())
        log.info("retraining %s champion v%s (MLflow run %s)", registered_model, champion.version, champion.run_id)
    if overrides:
        log.info("overrides: %s", overrides)
    return parse_spec({**base, **overrides}).model_dump()

"""validate_study: a tuning study's conf checked before any trial starts; its run directory and
its MLflow parent run made."""

from __future__ import annotations

import logging
import time
from typing import Any

from hetflow.paths import create_run_dir, write_record
from hetflow.pipeline.attempts import reported
from hetflow.tuning.space import parse_study, study_words

log = logging.getLogger("hetflow.stages")


@reported
def validate_study(
    values: dict[str, Any], run_id: str, dag_id: str | None = None, airflow_url: str | None = None
) -> dict[str, Any]:
    """Check the study (one line per problem, nothing started) and record it as ``study.json``; the
    returned record adds the MLflow parent run's page (``mlflow_run_url``, None without one)."""
    from hetflow.registry import live

    study = parse_study(values)
    paths = create_run_dir(run_id)
    write_record(paths.study, study.model_dump(mode="json"))
    mlflow_run_url = None
    if dag_id is not None:
        params = {
            **{f"choices.{key}": options for key, options in study.choices.items()},
            **{f"ranges.{key}": list(bounds) for key, bounds in study.ranges.items()},
            **{f"base.{key}": value for key, value in study.base.items()},
            "target_accuracy": study.target_accuracy,
            "trials": study.trials,
            "budget_seconds": study.budget_seconds,
            "parallel_trials": study.parallel_trials,
        }
        name = f"study {run_id}"
        mlflow_run_url = live.open_named_run(paths, name, params, dag_id, run_id, airflow_url, time.time())
    log.info("study: %s", study_words(study))
    return {**study.model_dump(mode="json"), "mlflow_run_url": mlflow_run_url}

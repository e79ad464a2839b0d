"""validate_spec: the run's conf checked once, before anything starts; the run directory created."""

from __future__ import annotations

import logging
from typing import Any

from hetflow.paths import create_run_dir, write_record
from hetflow.pipeline.attempts import attempt, reported
from hetflow.spec import SpecError, parse_spec

log = logging.getLogger("hetflow.stages")


@reported
def validate_spec(
    values: dict[str, Any],
    run_id: str,
    try_number: int | None = None,
    dag_id: str | None = None,
    airflow_url: str | None = None,
) -> dict[str, Any]:
    """Validate the run's conf (form values plus any extra keys); nothing starts when it is invalid.
    Under a DAG (``dag_id``), the run's MLflow run starts here, RUNNING, linking to ``airflow_url``;
    the record names its page (``mlflow_run_url``, None without one: Airflow's "MLflow run" link)."""
    from hetflow.cluster.backends.base import backend_for
    from hetflow.data.prepare import data_problems

    spec = parse_spec(values)
    problems = backend_for(spec).preflight(spec, run_id) + data_problems(spec)
    if problems:
        # Before any record is touched: a refused run id may belong to a run that is still going.
        raise SpecError(problems)
    paths = create_run_dir(run_id)
    mlflow_run_url = None
    with attempt(paths, "validate_spec", run_id, try_number) as receipt:
        write_record(paths.spec, spec.model_dump(mode="json"))
        if dag_id is not None:
            from hetflow.registry import live

            mlflow_run_url = live.open_run(paths, spec, dag_id, run_id, airflow_url)
    log.info("spec: %s", spec.model_dump())
    return {**spec.flat(), "attempt": receipt, "mlflow_run_url": mlflow_run_url}

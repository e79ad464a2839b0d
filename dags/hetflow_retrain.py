"""
### Retrain the champion: every Sunday at 03:00 UTC, and when the prepared data changes

Two triggers start this DAG, whichever comes first:

- **a schedule**: the cron `HETFLOW_RETRAIN_CRON` (default `0 3 * * 0`, Sundays 03:00 UTC);
- **new data**: an event on the Asset `hetflow://prepared-data`. `hetflow_train` adds one when
  it prepares a dataset whose contents changed; any other producer may add one too (the Asset's
  page, or `POST /api/v2/assets/events`).

It reads the spec the registered model's `champion` was trained with from MLflow, applies
**Overrides** (e.g. `{"epochs": 60}`), and triggers `hetflow_train` with it: the new version goes
through the same champion gate. It is paused when first created: unpause it to turn retraining on.
The first scheduled run is the cron's next time after that, never one already passed.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import Asset, AssetOrTimeSchedule, CronTriggerTimetable, dag, task

from hetflow.pipeline.task_log import CALLBACKS as TASK_LOG_CALLBACKS
from hetflow.registry.retrain import DEFAULT_CRON, PREPARED_DATA_URI
from hetflow.spec.form import form_param

CRON = os.environ.get("HETFLOW_RETRAIN_CRON", DEFAULT_CRON)


@dag(
    dag_id="hetflow_retrain",
    schedule=AssetOrTimeSchedule(
        # Airflow's default (run_immediately=False) still runs a cron time passed less than a tenth of
        # the period before the DAG is first unpaused (CronTriggerTimetable._calc_first_run): unpaused
        # on a Sunday before 19:48, it retrained at once. A zero window never runs a passed time.
        timetable=CronTriggerTimetable(CRON, timezone="UTC", run_immediately=timedelta(0)),
        assets=[Asset(PREPARED_DATA_URI)],
    ),
    catchup=False,
    max_active_runs=1,
    params={
        "registered_model": form_param(
            "hetflow-digits",
            type="string",
            title="Registered model",
            description="Retrain this MLflow registered model's champion.",
        ),
        "overrides": form_param(
            {},
            type="object",
            title="Overrides",
            description='hetflow_train fields to change from the champion\'s spec, by key, e.g. {"epochs": 60}.',
        ),
    },
    # Airflow 3.3's Schedule (the DAG list, the DAG page's header) shows an asset-triggered
    # timetable's assets only, never its summary "Asset or <cron>": this line names both triggers,
    # in the DAG page's Details tab and on the DAG list's name.
    description=f"Retrain the champion on the cron {CRON} (UTC) and when the prepared data changes",
    tags=["hetflow"],
    doc_md=__doc__,
    # Task logs: library stderr at DEBUG, a failure's headline last (hetflow/pipeline/task_log.py).
    default_args={"retries": 0, **TASK_LOG_CALLBACKS},
)
def hetflow_retrain():
    @task
    def champion_spec(params: dict[str, Any] | None = None):
        from hetflow.registry.retrain import retrain_spec

        return retrain_spec(params["registered_model"], params["overrides"])

    TriggerDagRunOperator(
        task_id="train",
        trigger_dag_id="hetflow_train",
        conf=champion_spec(),
        wait_for_completion=True,
        poke_interval=10,
        allowed_states=["success"],
        failed_states=["failed"],
    )


hetflow_retrain()

"""hetflow_retrain: train the champion's spec again when the prepared data changes, and on a cron.

Runs on whichever comes first: an event on the `hetflow://prepared-data` Asset (hetflow_train's
`prepare_data` emits one when a dataset's fingerprint changes; any producer may, e.g. through
`POST /api/v2/assets/events`) or the cron in `HETFLOW_RETRAIN_CRON` (default Sundays 03:00 UTC).
It reads the champion's spec from the MLflow registry, applies `overrides`, and triggers
`hetflow_train` with it, so the new version goes through the same champion gate. Paused when
first created: unpause it to turn retraining on.
"""

from __future__ import annotations

import os
from typing import Any

from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import Asset, AssetOrTimeSchedule, CronTriggerTimetable, Param, dag, task

from tasks.retrain import DEFAULT_CRON, PREPARED_DATA_URI


@dag(
    dag_id="hetflow_retrain",
    schedule=AssetOrTimeSchedule(
        timetable=CronTriggerTimetable(os.environ.get("HETFLOW_RETRAIN_CRON", DEFAULT_CRON), timezone="UTC"),
        assets=[Asset(PREPARED_DATA_URI)],
    ),
    catchup=False,
    max_active_runs=1,
    params={
        "registered_model": Param(
            "hetflow-digits",
            type="string",
            title="Registered model",
            description="Retrain this MLflow registered model's champion.",
        ),
        "overrides": Param(
            {},
            type="object",
            title="Overrides",
            description='RunSpec keys to change from the champion\'s spec, e.g. {"epochs": 60}.',
        ),
    },
    tags=["hetflow"],
    doc_md=__doc__,
    default_args={"retries": 0},
)
def hetflow_retrain():
    @task
    def champion_spec(params: dict[str, Any] | None = None):
        from tasks.retrain import retrain_spec

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

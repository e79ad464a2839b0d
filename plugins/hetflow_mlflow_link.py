"""An "MLflow run" button on every task of a hetflow DAG run, opening the run's MLflow page.

Airflow 3 shows a task's extra links on its page; a link on hetflow's own tasks would need an
operator class of our own, so this one is global and answers only for hetflow's DAGs (for any other
task it answers nothing, and Airflow shows no button). The address is ``mlflow_run_url`` in what the
run's first task returned when it opened the MLflow run (hetflow.registry.live): read, never built
from what a user typed, and shown only when it is a web address.
"""

from __future__ import annotations

import json

from airflow.models.xcom import XCOM_RETURN_KEY, XComModel
from airflow.plugins_manager import AirflowPlugin
from airflow.sdk import BaseOperatorLink
from airflow.utils.session import create_session

# The task of each hetflow DAG that opens the run's MLflow run (and returns its page's address).
OPENED_BY = {"hetflow_train": "validate_spec", "hetflow_tune": "validate_study"}


class MLflowRunLink(BaseOperatorLink):
    name = "MLflow run"

    def get_link(self, operator, *, ti_key) -> str:
        opener = OPENED_BY.get(ti_key.dag_id)
        if opener is None:
            return ""
        with create_session() as session:
            pushed = session.execute(
                XComModel.get_many(
                    key=XCOM_RETURN_KEY, run_id=ti_key.run_id, dag_ids=ti_key.dag_id, task_ids=opener
                ).with_only_columns(XComModel.value)
            ).first()
        if pushed is None:
            return ""
        record = json.loads(pushed.value) if isinstance(pushed.value, str) else pushed.value
        url = record.get("mlflow_run_url") if isinstance(record, dict) else None
        return url if isinstance(url, str) and url.startswith(("http://", "https://")) else ""


class HetflowMLflowLinkPlugin(AirflowPlugin):
    name = "hetflow_mlflow_link"
    global_operator_extra_links = [MLflowRunLink()]

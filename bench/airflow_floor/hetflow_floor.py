"""bench/overhead.py's Airflow floor: hetflow_train's ten tasks, their wiring, trigger rules, set-up and
teardown, and its trigger form, with every task's body empty. One run of it through ``dag.test`` costs what
Airflow itself costs a run of that DAG; hetflow's task callbacks are left out, as hetflow's own."""

from __future__ import annotations

from airflow.dag_processing.dagbag import DagBag
from airflow.sdk import DAG, task

from hetflow.paths import REPO_ROOT

TRAIN = DagBag(dag_folder=str(REPO_ROOT / "dags")).dags["hetflow_train"]

with DAG(
    dag_id="hetflow_floor",
    schedule=None,
    catchup=False,
    is_paused_upon_creation=False,
    params=TRAIN.params,
    default_args={"retries": 0},
) as hetflow_floor:  # bound: Airflow collects the DAGs a DAG file binds
    empty_tasks = {}
    for train_task in TRAIN.tasks:

        @task(task_id=train_task.task_id, trigger_rule=train_task.trigger_rule)
        def nothing() -> None:
            return None

        empty_task = empty_tasks[train_task.task_id] = nothing()
        if train_task.is_setup:
            empty_task.as_setup()
        if train_task.is_teardown:
            empty_task.as_teardown()
    for train_task in TRAIN.tasks:
        for upstream in train_task.upstream_task_ids:
            empty_tasks[upstream] >> empty_tasks[train_task.task_id]

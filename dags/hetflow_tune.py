"""
### Tune a run: the fastest strategy and optimizer settings to a target accuracy, on your cluster

Press **Trigger** to start a study. **Search space**: the values of each setting to try (a list;
empty: the base spec's value) and `[low, high]` ranges. **Study**: the target validation accuracy,
how many trials, the wall-time budget, and `base`, the spec keys every trial shares (dataset, model,
epochs, backend, ...).

Each trial is a real run: its replicas are provisioned, trained until the target (or their epochs)
and torn down, one trial at a time (**parallel_trials**: several at once, each on its own cluster,
where the backend has room for them). Optuna's TPE sampler picks each trial's settings; a trial whose
validation accuracy is behind the median of the earlier trials at the same time since launch is
pruned (stopped, torn down). The study ranks trials by time from launch to the target accuracy.

The best trial goes on: evaluate, compress, export, register with the champion gate; its registered
versions carry the tags `tuning.study` and `tuning.trial`. In **MLflow**, the study is a parent run
with a table of its trials and two charts (time to target per trial; the best sync and the best
async trial's validation accuracy against wall-clock time), each trial a nested run.

A retried `run_study` resumes the study: an interrupted trial runs again once, and only the trials
still owed run.
"""

# Wiring only, as hetflow_train: each task calls hetflow.tasks.<task_id>.<task_id>.

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import dag, task

from hetflow.pipeline.task_log import DAG_ARGUMENTS
from hetflow.tuning.form import tune_params


@dag(
    dag_id="hetflow_tune",
    params=tune_params(),
    description="Tune a run: the fastest strategy and optimizer settings to a target accuracy",
    doc_md=__doc__,
    **DAG_ARGUMENTS,
)
def hetflow_tune():
    @task
    def validate_study(params: dict[str, Any] | None = None, dag_run=None, run_id: str | None = None):
        from hetflow.registry.live import airflow_run_url
        from hetflow.tasks import validate_study as stage
        from hetflow.tuning.form import study_values

        page = airflow_run_url(dag_run.dag_id, run_id)
        return stage.validate_study(study_values({**params, **(dag_run.conf or {})}), run_id, dag_run.dag_id, page)

    # A retry resumes the study (hetflow.tuning.study): the interrupted trial runs again, once.
    @task(retries=1, retry_delay=timedelta(seconds=10))
    def run_study(run_id: str | None = None, dag_run=None):
        from hetflow.registry.live import airflow_run_url
        from hetflow.tasks import run_study as stage

        page = airflow_run_url(dag_run.dag_id, run_id)
        return stage.run_study(run_id, page)

    @task
    def evaluate(best: dict[str, Any], ti=None):
        from hetflow.tasks import evaluate as stage

        return stage.evaluate(best["best_run_id"], ti.try_number)

    @task
    def compress(best: dict[str, Any], ti=None):
        from hetflow.tasks import compress as stage

        return stage.compress(best["best_run_id"], ti.try_number)

    @task
    def export(best: dict[str, Any], ti=None):
        from hetflow.tasks import export as stage

        return stage.export(best["best_run_id"], ti.try_number)

    @task
    def register(best: dict[str, Any], dag=None, ti=None):
        from hetflow.tasks import register as stage

        return stage.register(best["best_run_id"], dag.dag_id, ti.try_number)

    @task
    def finish_study(best: dict[str, Any], run_id: str | None = None):
        from hetflow.tasks import finish_study as stage

        return stage.finish_study(run_id, best)

    best = run_study()
    validate_study() >> best
    best >> evaluate(best) >> compress(best) >> export(best) >> register(best) >> finish_study(best)


hetflow_tune()

"""
### Train a TensorFlow model on several replicas and register it in MLflow

Press **Trigger** to start a run. The form has a default for every field; the ones people
change most:

- **Data**: the dataset (the default, `uci_digits`, is built offline; `folder:/PATH` reads your
  own images, one sub-folder per class).
- **Model** and **Cluster**: the architecture, the distribution strategy, how many workers and
  parameter servers, and where the replicas run (local processes, Docker containers, Kubernetes
  pods). Fields only some backends read are in sections named for them ("Cluster on kubernetes"),
  and optional.
- **Training**: epochs, batch size, learning rate; **Compression**, **Export**, **Registry**: the
  TFLite variants, and the registered model the new version joins.

Every value is checked when you press Trigger: a refused value is named, with what is allowed,
right above the button, and no run starts. Only what needs the run's files, the network or a
cluster is checked by the run's first task, *validate_spec*: a `folder:` dataset's images, a
download of a dataset not prepared yet, the backend's engine, nodes or Kubernetes context.

A run prepares the data, starts the replicas, trains, always stops the replicas, evaluates the
model, compresses and exports it, registers it, and summarizes. Where the results go:

- **MLflow**, experiment `hetflow`: one run per DAG run, named after the model, strategy,
  replicas and start time, with the parameters, curves, test accuracy, plots and replica logs;
  a new version of the registered model with the alias `candidate`, and `champion` when it beats
  the current champion by at least *min improvement*.
- **This run's task logs**: each stage says what it did; a failed stage's log ends with one
  ERROR line naming it and the cause.
- **`$HETFLOW_HOME/runs/<run id>-<hash>/summary.json`**: the whole run in one file.
"""

# For developers: this file is wiring only. Every task calls the function of its own name in the
# module of its own name, ``hetflow.tasks.<task_id>.<task_id>``, imported inside the task so that parsing
# this file never imports TensorFlow (the dag-processor re-parses it every few seconds). The
# trigger form's fields are generated from ``hetflow.spec.RunSpec``. Each stage gets its task's try
# number, which its record's receipt names; ``summarize`` checks the receipts against what the
# stages returned.

from __future__ import annotations

from typing import Any

from airflow.sdk import Asset, AssetAlias, dag, task

from hetflow.pipeline.task_log import DAG_ARGUMENTS
from hetflow.registry.retrain import PREPARED_DATA_URI
from hetflow.serving.control import CHAMPION_ASSET_URI
from hetflow.spec import airflow_params

# prepare_data adds an event on the prepared-data Asset through this alias only when the data's
# fingerprint changed: a task's plain outlets would get an event on every run.
DATA_CHANGES = AssetAlias("hetflow_data_changes")
# Likewise register adds an event on the champion Asset (hetflow_deploy's schedule) only for each model
# whose champion it moved, the model and version in the event's extra.
CHAMPION_MOVES = AssetAlias("hetflow_champion_moves")


@dag(
    dag_id="hetflow_train",
    params=airflow_params(),
    description="Train a TensorFlow model on several replicas and register it in MLflow",
    doc_md=__doc__,
    # No max_active_runs: concurrent runs (two triggers, a retrain beside a manual run) are a
    # feature, made safe rather than forbidden: `champion` moves under one lock per registered
    # model (hetflow.registry.champion.promotion_lock). How many runs fit at once is a question of capacity
    # (each replica holds ~1 GB), which the operator sets with [core] max_active_runs_per_dag.
    **DAG_ARGUMENTS,
)
def hetflow_train():
    @task
    def validate_spec(params: dict[str, Any] | None = None, dag_run=None, run_id: str | None = None, ti=None):
        from hetflow.registry.live import airflow_run_url
        from hetflow.tasks import validate_spec as stage

        # params hold the form values (conf applied); conf may also carry keys the form does not
        # know, which must be rejected rather than ignored.
        values = {**params, **(dag_run.conf or {})}
        page = airflow_run_url(dag_run.dag_id, run_id)
        return stage.validate_spec(values, run_id, ti.try_number, dag_run.dag_id, page)

    @task(outlets=[DATA_CHANGES])
    def prepare_data(run_id: str | None = None, outlet_events=None, ti=None):
        from hetflow.paths import run_paths
        from hetflow.records import DatasetRecord
        from hetflow.tasks import prepare_data as stage

        returned = stage.prepare_data(run_id, ti.try_number)
        dataset = DatasetRecord.read(run_paths(run_id))
        if dataset.data_changed:
            extra = {"name": dataset.name, "version": dataset.version, "fingerprint": dataset.fingerprint}
            outlet_events[DATA_CHANGES].add(Asset(PREPARED_DATA_URI), extra=extra)
        if dataset.trained_before:
            from airflow.sdk.exceptions import AirflowSkipException

            # Skipped, every task downstream is skipped too; summarize still reads the record.
            ti.xcom_push(key="return_value", value=returned)
            raise AirflowSkipException(dataset.skip_reason)
        return returned

    @task
    def provision_cluster(run_id: str | None = None, ti=None):
        from hetflow.tasks import provision_cluster as stage

        return stage.provision_cluster(run_id, ti.try_number)

    @task
    def train(run_id: str | None = None, ti=None):
        from hetflow.tasks import train as stage

        return stage.train(run_id, ti.try_number)

    @task
    def teardown_cluster(run_id: str | None = None):
        from hetflow.tasks import teardown_cluster as stage

        return stage.teardown_cluster(run_id)

    @task
    def evaluate(run_id: str | None = None, ti=None):
        from hetflow.tasks import evaluate as stage

        return stage.evaluate(run_id, ti.try_number)

    @task
    def compress(run_id: str | None = None, ti=None):
        from hetflow.tasks import compress as stage

        return stage.compress(run_id, ti.try_number)

    @task
    def export(run_id: str | None = None, ti=None):
        from hetflow.tasks import export as stage

        return stage.export(run_id, ti.try_number)

    @task(outlets=[CHAMPION_MOVES])
    def register(run_id: str | None = None, dag=None, outlet_events=None, ti=None):
        from hetflow.tasks import register as stage

        returned = stage.register(run_id, dag.dag_id, ti.try_number)
        for moved in returned["champion_moves"]:
            outlet_events[CHAMPION_MOVES].add(Asset(CHAMPION_ASSET_URI), extra=moved)
        return returned

    @task(trigger_rule="all_done")
    def summarize(run_id: str | None = None, dag_run=None, ti=None):
        from hetflow.pipeline.attempts import STAGES
        from hetflow.tasks import summarize as stage

        # None for a stage whose last try failed or never ran: Airflow deletes a task's XComs when a try starts.
        returned = {name: ti.xcom_pull(task_ids=name) for name in STAGES}
        started = dag_run.start_date.timestamp() if dag_run.start_date else None  # the DAG's wall time runs from here
        return stage.summarize(run_id, returned, started)

    cluster = provision_cluster()
    trained = train()
    down = teardown_cluster().as_teardown(setups=cluster)
    registered = register()
    validate_spec() >> prepare_data() >> cluster >> trained >> down
    trained >> evaluate() >> compress() >> export() >> registered
    [registered, down] >> summarize()


hetflow_train()

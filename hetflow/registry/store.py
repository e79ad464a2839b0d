"""The MLflow store a deployment uses, hetflow's experiment in it, and the one MLflow run of each
DAG run (found again by the Airflow run id, so a retried task creates no second one)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from urllib.parse import quote

from mlflow.exceptions import MlflowException

from hetflow.paths import REPO_ROOT
from hetflow.registry import charts_view
from mlflow import MlflowClient

EXPERIMENT = "hetflow"
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
# MLflow 3's UI opens an experiment of no declared kind in its GenAI view (traces, an assistant
# panel); hetflow's holds model-training runs, which the UI then shows first, with the registry.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"


# Where people open the MLflow UI, where it is not the tracking URI: a stack whose tasks write to the
# store directly (`make up`) or reach the server by an address only they resolve (`make up-docker`).
MLFLOW_UI_ENV = "HETFLOW_MLFLOW_UI_URL"


def tracking_uri() -> str:
    return os.environ.get(TRACKING_URI_ENV) or f"sqlite:///{REPO_ROOT / 'mlflow' / 'mlflow.db'}"


def client(uri: str | None = None) -> MlflowClient:
    """A client of the store at ``uri`` (None: ``tracking_uri()``) for runs and the registry alike.
    Given no registry URI, MLflow reads it from process-wide state (MLFLOW_REGISTRY_URI, then
    MLFLOW_TRACKING_URI, then its default store in the working directory), which another thread may
    be changing and which a user's shell need not set: every hetflow client names both."""
    uri = uri or tracking_uri()
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def ensure_experiment(client: MlflowClient) -> str:
    """hetflow's experiment, created where missing and its tags made current; returns its id."""
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment:  # made by an earlier hetflow, maybe without these tags
        if experiment.tags.get(EXPERIMENT_KIND_TAG) != MODEL_TRAINING:
            client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
        if not charts_view.is_current(experiment.tags.get(charts_view.TAG)):
            client.set_experiment_tag(experiment.experiment_id, charts_view.TAG, charts_view.tag_value())
        return experiment.experiment_id
    return create_experiment(
        client, EXPERIMENT, {EXPERIMENT_KIND_TAG: MODEL_TRAINING, charts_view.TAG: charts_view.tag_value()}
    )


def create_experiment(client: MlflowClient, name: str, tags: dict[str, str]) -> str:
    """A new experiment whose artifacts a SQLite store keeps beside its database (MLflow's default
    would be ./mlruns, wherever the process runs); a tracking server decides for itself."""
    uri = client.tracking_uri
    location = Path(uri.removeprefix("sqlite:///")).parent / "artifacts" if uri.startswith("sqlite:///") else None
    return client.create_experiment(name, artifact_location=location.as_uri() if location else None, tags=tags)


# The query every page hetflow links to carries: MLflow 3.17's UI shows an experiment in the view its
# workflow switch holds (the browser's ``mlflow.workflowType``, GenAI until the person switches), and a
# page's own ``workflowType`` wins over it for that page.
TRAINING_VIEW = "workflowType=machine_learning"


def runs_page(server_url: str, key_metrics: bool = False, store: str | None = None, run_id: str | None = None) -> str:
    """The MLflow UI's page of hetflow's runs, the experiment created if need be. MLflow 3.17's UI
    opens an experiment in the view its workflow switch holds, GenAI unless the user switched,
    whatever the experiment's kind: the page's own ``workflowType`` asks for the training runs.

    :param key_metrics: the page's chart view, the key metrics' charts first; else its runs table,
        with test accuracy and training time columns (both in hetflow's saved view, ``charts_view``).
    :param store: the tracking URI the experiment is in; None: ``tracking_uri()``.
    :param run_id: that run alone (its search filter).
    """
    try:
        experiment_id = ensure_experiment(client(store))
    except MlflowException:  # a store that does not answer yet: the experiments' list, in the same view
        return f"{server_url}/#/experiments?{TRAINING_VIEW}"
    page = f"{server_url}/#/experiments/{experiment_id}/runs?{TRAINING_VIEW}"
    if run_id:
        search = f"attributes.run_id = '{run_id}'"
        page += f"&searchFilter={quote(search, safe='')}"
    view = f"viewStateShareKey={charts_view.VIEW_ID}"  # the runs table's columns and the charts' order
    return f"{page}&compareRunsMode=CHART&{view}" if key_metrics else f"{page}&{view}"


def run_page(uri: str, run_id: str, live: bool = False) -> str:
    """Where a person opens the run: its page in the MLflow UI (``HETFLOW_MLFLOW_UI_URL``'s, else
    the tracking server's), else the run's id in the store.

    :param live: the page that shows its curves while it trains: the experiment's chart view of that
        run alone. MLflow 3.17.2's run page makes its charts of the metrics the run held when it was
        loaded and never reads the run again (Auto-refresh re-reads those charts' points only): opened
        before the first epoch, it says "No charts in this section" until reloaded. The experiment's
        chart view searches the runs again every 30 s and adds a chart for each new metric.
    """
    web = ("http://", "https://")
    ui = (os.environ.get(MLFLOW_UI_ENV) or uri).rstrip("/")
    if not ui.startswith(web):
        return f"run {run_id} in {uri}"
    if live:
        return runs_page(ui, key_metrics=True, store=uri, run_id=run_id)
    run = client(uri).get_run(run_id)
    return f"{ui}/#/experiments/{run.info.experiment_id}/runs/{run_id}?{TRAINING_VIEW}"


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def find_or_create_run(
    client: MlflowClient, dag_id: str, airflow_run_id: str, run_name: str, started: float | None = None
) -> str:
    """The MLflow run of this DAG run, created on first use.

    :param started: when the pipeline started (unix time): the run's start in MLflow, so that its
        duration covers the stages and not only the logging; None: now.
    """
    experiment_id = ensure_experiment(client)
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`airflow.dag_id` = '{dag_id}' and tags.`airflow.run_id` = '{airflow_run_id}'",
        max_results=1,
    )
    if found:
        return found[0].info.run_id
    run = client.create_run(
        experiment_id,
        start_time=None if started is None else int(started * 1000),
        run_name=run_name,
        tags={"airflow.dag_id": dag_id, "airflow.run_id": airflow_run_id},
    )
    return run.info.run_id


def finish_run(client: MlflowClient, run_id: str) -> None:
    """Mark the run finished now, after the last stage that records in it."""
    client.set_terminated(run_id, "FINISHED")

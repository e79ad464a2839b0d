"""hetflow's saved chart view of its MLflow experiment, as the store writes it: an experiment tag
in the form MLflow 3.17's UI reads (tests/test_e2e_ui_mlflow.py opens it in Chromium)."""

from __future__ import annotations

import json

import pytest

from hetflow.registry import store
from mlflow import MlflowClient

VIEW_TAG = "mlflow.sharedViewState.hetflow-key-metrics"


@pytest.fixture
def client(tmp_path, monkeypatch) -> MlflowClient:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return MlflowClient(uri)


def _view(client: MlflowClient) -> dict:
    return json.loads(client.get_experiment_by_name("hetflow").tags[VIEW_TAG])


def test_the_experiment_holds_the_key_metrics_view_in_the_uis_saved_view_form(client):
    store.ensure_experiment(client)
    view = _view(client)
    assert view["name"] == "Key metrics first" and view["createdAt"] == view["updatedAt"] > 0
    state = json.loads(view["state"])
    first, *others = state["compareRunSections"]
    assert first["name"] == "Key metrics" and [s["name"] for s in others] == ["Model metrics", "System metrics"]
    assert state["isAccordionReordered"] is True and first["isReordered"] is True
    charts = state["compareRunCharts"]
    assert [c["metricKey"] for c in charts] == [
        "test_accuracy",
        "val_accuracy",
        "train_accuracy",
        "test_loss",
        "val_loss",
        "train_loss",
        "examples_per_second",
    ]
    assert all(c["metricSectionId"] == first["uuid"] for c in charts)
    per_epoch = {c["metricKey"] for c in charts if c["type"] == "LINE"}
    assert per_epoch == {"val_accuracy", "train_accuracy", "val_loss", "train_loss"}
    # The runs table: test accuracy, training seconds and speed, the registered versions, the source.
    assert state["selectedColumns"] == [
        "metrics.`test_accuracy`",
        "metrics.`train_seconds`",
        "metrics.`examples_per_second`",
        "tags.`registered`",
        "attributes.`Source`",
    ]


def test_an_older_experiment_gets_the_view_and_a_current_one_is_left_as_it_is(client):
    experiment_id = client.create_experiment("hetflow")  # as a hetflow before the view made it
    assert store.ensure_experiment(client) == experiment_id
    written = _view(client)
    store.ensure_experiment(client)
    assert _view(client) == written  # not written again
    stale = {**written, "state": json.dumps({"compareRunCharts": []})}
    client.set_experiment_tag(experiment_id, VIEW_TAG, json.dumps(stale))
    store.ensure_experiment(client)
    assert json.loads(_view(client)["state"]) == json.loads(written["state"])


def test_runs_page_links_the_view_in_the_table_and_in_the_chart_view(client):
    experiment_id = store.ensure_experiment(client)
    page = f"http://mlflow/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    assert store.runs_page("http://mlflow") == f"{page}&viewStateShareKey=hetflow-key-metrics"
    assert store.runs_page("http://mlflow", key_metrics=True) == (
        f"{page}&compareRunsMode=CHART&viewStateShareKey=hetflow-key-metrics"
    )


def test_runs_page_makes_the_experiment_in_the_store_it_is_given(client, tmp_path):
    """make up-docker's store is its MLflow server, not the tracking URI of the shell running it."""
    (tmp_path / "server").mkdir()
    server = MlflowClient(f"sqlite:///{tmp_path / 'server' / 'mlflow.db'}")
    page = store.runs_page("http://mlflow", store=server.tracking_uri)
    experiment = server.get_experiment_by_name("hetflow")
    runs = f"http://mlflow/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning"
    assert page == f"{runs}&viewStateShareKey=hetflow-key-metrics"
    assert experiment.artifact_location == (tmp_path / "server" / "artifacts").as_uri()
    assert client.get_experiment_by_name("hetflow") is None


def test_a_runs_page_opens_in_the_experiments_training_view(client, monkeypatch):
    """The address validate_spec logs, the Airflow button opens and summary.json keeps: the run's page,
    asking for the training view as runs_page does (MLflow's own starts browsers in GenAI)."""
    experiment_id = store.ensure_experiment(client)
    run_id = client.create_run(experiment_id).info.run_id
    monkeypatch.setenv("HETFLOW_MLFLOW_UI_URL", "http://127.0.0.1:5000")
    page = store.run_page(client.tracking_uri, run_id)
    assert page == f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def test_a_training_runs_live_page_is_the_experiments_chart_view_of_that_run_alone(client, monkeypatch):
    """MLflow 3.17.2's run page keeps the charts of the metrics the run had when it was opened (none,
    before the first epoch); the experiment's chart view adds them as they come (tests/test_e2e_ui_mlflow.py)."""
    experiment_id = store.ensure_experiment(client)
    run_id = client.create_run(experiment_id).info.run_id
    monkeypatch.setenv("HETFLOW_MLFLOW_UI_URL", "http://127.0.0.1:5000/")
    assert store.run_page(client.tracking_uri, run_id, live=True) == (
        f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
        f"&searchFilter=attributes.run_id%20%3D%20%27{run_id}%27"
        "&compareRunsMode=CHART&viewStateShareKey=hetflow-key-metrics"
    )
    monkeypatch.delenv("HETFLOW_MLFLOW_UI_URL")
    assert store.run_page(client.tracking_uri, run_id, live=True) == f"run {run_id} in {client.tracking_uri}"

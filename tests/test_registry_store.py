"""hetflow.registry.store: the MLflow store a process uses, and the one call that needs MLflow's
process-wide URI (a flavor's log_model) pointed at a client's store for that call only."""

from __future__ import annotations

import os

import pytest

import mlflow
from hetflow.registry.store import fluent_tracking_uri


@pytest.mark.parametrize("before", [None, "sqlite:///another-store.db"], ids=["unset", "set"])
def test_the_fluent_api_logs_into_the_clients_store_and_the_environment_is_left_as_it_was(
    before, tmp_path, monkeypatch
):
    """The served check that follows in register reads MLFLOW_TRACKING_URI: once, restoring MLflow's
    own setting deleted it, and the check looked for the new version in MLflow's default store."""
    if before is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", before)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("fluent", artifact_location=(tmp_path / "a").as_uri()))
    with fluent_tracking_uri(uri), mlflow.start_run(run_id=run.info.run_id):
        mlflow.log_param("logged", "here")
    assert client.get_run(run.info.run_id).data.params == {"logged": "here"}
    assert os.environ.get("MLFLOW_TRACKING_URI") == before

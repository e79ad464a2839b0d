"""The study's parent run in MLflow, after its winner went through register: which trial that was,
what the gate decided, and its test accuracy in the runs table's column (it showed "-"). A real
SQLite store; tests/test_e2e_ui_tune.py shows the page in Chromium."""

from __future__ import annotations

import json

from hetflow.paths import RunPaths
from hetflow.tuning.report import report_winner
from mlflow import MlflowClient

REGISTRY = {
    "models": [
        {"model_name": "hetflow-digits", "version": 4, "aliases": ["candidate", "champion"], "gate": "first version"},
        {"model_name": "hetflow-digits-tflite", "version": 4, "aliases": ["candidate"], "gate": "served check failed"},
    ]
}


def test_the_study_run_names_the_trial_that_registered_and_the_gates_decisions(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("hetflow")).info.run_id
    table = "Trials to validation accuracy 0.9, fastest first.\n\n```\ntrial  state\n3      complete\n```"
    client.set_tag(run_id, "mlflow.note.content", table)
    paths = RunPaths(tmp_path / "study")
    paths.root.mkdir()
    paths.tracking.write_text(json.dumps({"tracking_uri": uri, "mlflow_run_id": run_id}))
    for _ in range(2):  # a retried finish_study says it once
        report_winner(paths, 3, REGISTRY, 0.961038961)
    run = client.get_run(run_id)
    assert run.data.metrics["test_accuracy"] == 0.961
    assert run.data.tags["tuning.registered_trial"] == "3" and run.data.tags["registry.gate"] == "first version"
    assert run.data.tags["mlflow.note.content"] == (
        "**Trial 3 went on to register**, test accuracy 0.9610:\n"
        "- hetflow-digits v4 (candidate, champion): first version\n"
        "- hetflow-digits-tflite v4 (candidate): served check failed\n\n---\n\n" + table
    )

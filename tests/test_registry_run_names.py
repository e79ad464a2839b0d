"""What a person reads of a run in MLflow's lists and charts: its name says what differs from other
runs, the time last; its curves read at the precision they were computed in; each replica's CPU and
memory are system metrics (MLflow's System metrics section). Real SQLite stores, no server."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
import pytest

from hetflow.pipeline.progress import Epoch
from hetflow.registry.live import LiveRun
from hetflow.registry.run_record import run_name
from hetflow.spec import RunSpec
from mlflow import MlflowClient

AT_13_21_22 = datetime(2026, 12, 1, 13, 21, 22, tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize(
    ("values", "name"),
    [
        ({}, "defaults 13:21:22"),
        ({"epochs": 5, "strategy": "multi_worker_mirrored", "workers": 2}, "sync 2w epochs=5 13:21:22"),
        ({"epochs": 40, "strategy": "multi_worker_mirrored", "workers": 2}, "sync 2w 13:21:22"),
        (
            {"dataset": "folder:/data/cats/", "strategy": "parameter_server", "workers": 2, "ps": 1, "batch_size": 64},
            "cats async 2w+1ps batch_size=64 13:21:22",
        ),
        ({"learning_rate": 0.01, "export_formats": ["tflite"]}, "learning_rate=0.01 export_formats=tflite 13:21:22"),
        (  # what changes the model first, how it ran and where it is registered last
            {"registered_model": "ui-live", "train_timeout_seconds": 120, "epochs": 1000, "model": "convnet"},
            "epochs=1000 model=convnet train_timeout_seconds=120 registered_model=ui-live 13:21:22",
        ),
    ],
)
def test_a_runs_name_leads_with_what_differs_and_ends_with_its_time(values, name):
    assert run_name(RunSpec.from_values(values), AT_13_21_22) == name


def test_runs_of_5_and_40_epochs_differ_within_what_a_chart_legend_shows():
    """MLflow's chart legends showed "uci_digits sync 2w mlp 2…" for both: 24 characters."""
    names = [
        run_name(RunSpec.from_values({"epochs": epochs, "strategy": "multi_worker_mirrored", "workers": 2}), None)
        for epochs in (5, 50)
    ]
    assert names[0][:24] != names[1][:24], names


def test_the_live_run_logs_float32_figures_as_typed_and_usage_as_system_metrics(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("live")).info.run_id
    live = LiveRun(client, run_id)
    live([], {"worker-0": {"memory_mb": 402.0}})  # sampled while the replicas start, before any epoch
    float32 = {"learning_rate": 0.001, "loss": 0.4123, "val_accuracy": 0.9610}  # as Keras hands them: float32
    live(
        [Epoch(1, {name: float(np.float32(value)) for name, value in float32.items()}, {"worker-0": 2481.0001})],
        {"worker-0": {"cpu_percent": 98.5, "memory_mb": 812.3}, "ps-0": {"memory_mb": 640.0}},
    )
    metrics = client.get_run(run_id).data.metrics
    # MLflow's run page lists metrics in the order they first came: the curves, accuracy first.
    assert list(metrics)[:2] == ["val_accuracy", "train_loss"], list(metrics)
    assert [m.value for m in client.get_metric_history(run_id, "system/memory_mb_worker-0")] == [402.0, 812.3]
    assert metrics["learning_rate"] == 0.001 and metrics["val_accuracy"] == 0.961 and metrics["train_loss"] == 0.4123
    assert metrics["epoch_examples_per_second/worker-0"] == 2481.0
    usage = {key: value for key, value in metrics.items() if "cpu" in key or "memory" in key}
    assert usage == {
        "system/cpu_percent_worker-0": 98.5,
        "system/memory_mb_worker-0": 812.3,
        "system/memory_mb_ps-0": 640.0,
    }


def test_the_runs_table_column_names_each_runs_versions_and_the_aliases_they_hold_now(tmp_path):
    """The gate moves champion to a newer run's version: the older run's column stops saying champion."""
    from hetflow.registry.run_record import tag_registered

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    experiment = client.create_experiment("hetflow")
    for name in ("hetflow-digits", "hetflow-digits-tflite"):
        client.create_registered_model(name)

    def registered(aliases: dict[str, list[str]]) -> str:
        run_id = client.create_run(experiment).info.run_id
        for name, held in aliases.items():
            version = client.create_model_version(name, source=str(tmp_path / "model"), run_id=run_id).version
            for alias in held:
                client.set_registered_model_alias(name, alias, version)
        tag_registered(client, run_id)
        return run_id

    both = ["candidate", "champion"]
    first = registered({"hetflow-digits": both, "hetflow-digits-tflite": both})
    assert client.get_run(first).data.tags["registered"] == (
        "hetflow-digits v1 @champion @candidate · -tflite v1 @champion @candidate"
    )
    second = registered({"hetflow-digits": both, "hetflow-digits-tflite": ["candidate"]})
    assert client.get_run(second).data.tags["registered"] == (
        "hetflow-digits v2 @champion @candidate · -tflite v2 @candidate"
    )
    assert client.get_run(first).data.tags["registered"] == "hetflow-digits v1 · -tflite v1 @champion"

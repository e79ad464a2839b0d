"""End to end: `hetflow run` drives the real DAG through Airflow; results read back as a user would."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
from conftest import E2E_MODEL as MODEL
from conftest import replica_listening, run_dag

from hetflow.paths import RunPaths
from hetflow.records import DatasetRecord
from hetflow.spec import SPEC_KEYS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def first(e2e_first_run):
    return e2e_first_run


@pytest.fixture(scope="module")
def second(hetflow_env, first):
    """A later run that cannot pass the gate (min_improvement=1), its layers on two stage replicas."""
    return run_dag(hetflow_env, "epochs=2", "min_improvement=1", "strategy=model_parallel", "workers=2")


@pytest.fixture(scope="module")
def client(hetflow_env):
    from mlflow import MlflowClient

    return MlflowClient(hetflow_env["MLFLOW_TRACKING_URI"])


def test_run_succeeds_and_streams_replica_progress(first):
    done, summary = first
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary["status"] == "success" and summary["failed_stage"] is None
    assert "[worker-0] Epoch 1/15" in done.stdout and "[worker-0] Epoch 15/15" in done.stdout
    replica_log = Path(summary["run_dir"]) / "logs" / "worker-0.log"
    assert summary["artifacts"]["replica_logs"] == [str(replica_log)]
    assert "Epoch 15/15" in replica_log.read_text()
    assert summary["metrics"]["test_accuracy"] >= 0.9
    assert summary["metrics"]["examples_per_second"] > 0
    assert summary["artifacts"]["model"]["bytes"] > 10_000
    assert summary["artifacts"]["plots"][0].endswith("confusion_matrix.png")


def test_no_replica_or_port_outlives_the_run(first):
    from hetflow.cluster.processes import run_processes

    _, summary = first
    assert run_processes(summary["run_id"]) == []
    cluster = json.loads((Path(summary["run_dir"]) / "cluster.json").read_text())
    assert not any(replica_listening(cluster, replica["address"]) for replica in cluster["replicas"])


def test_mlflow_run_records_tags_params_curves_and_artifacts(first, client):
    _, summary = first
    run = client.get_run(summary["mlflow_run_id"])
    tags = run.data.tags
    assert tags["airflow.dag_id"] == "hetflow_train"
    assert tags["airflow.run_id"] == summary["run_id"]
    assert tags["airflow.url"].endswith(f"/dags/hetflow_train/runs/{quote(summary['run_id'], safe='')}")
    assert run.info.status == "FINISHED"
    assert f"[The Airflow run]({tags['airflow.url']})" in tags["mlflow.note.content"]
    assert tags["dataset.name"] == "uci_digits" and tags["dataset.version"] == "1.0.0"
    assert tags["dataset.fingerprint"] == summary["dataset"]["fingerprint"]
    assert re.fullmatch(r"[0-9a-f]{40}", tags["mlflow.source.git.commit"])
    params = run.data.params
    assert params["epochs"] == "15" and params["model"] == "mlp" and params["registered_model"] == MODEL
    assert set(params) >= set(SPEC_KEYS)
    # MLflow shows the run's figures at 4 significant digits; summary.json keeps every digit.
    accuracy = run.data.metrics["test_accuracy"]
    assert accuracy == pytest.approx(summary["metrics"]["test_accuracy"], abs=5e-5) and round(accuracy, 4) == accuracy
    curve = client.get_metric_history(run.info.run_id, "val_accuracy")
    assert sorted(m.step for m in curve) == list(range(1, 16))
    # Logged live by train (register adds no second point), with what only the pipeline's sampling gives.
    assert len(client.get_metric_history(run.info.run_id, "train_loss")) == 15
    assert client.get_metric_history(run.info.run_id, "system/memory_mb_worker-0")
    artifacts = {a.path for folder in ("run", "logs", "plots") for a in client.list_artifacts(run.info.run_id, folder)}
    assert {"run/spec.json", "run/training.json", "logs/worker-0.log", "plots/confusion_matrix.png"} <= artifacts


def test_first_version_is_candidate_and_champion_and_predicts_the_test_split(first, client):
    import mlflow
    from hetflow.data.pipeline import split_arrays

    _, summary = first
    assert summary["registry"]["version"] == 1
    assert summary["registry"]["aliases"] == ["candidate", "champion"]
    champion = client.get_model_version_by_alias(MODEL, "champion")
    assert int(champion.version) == 1 and champion.run_id == summary["mlflow_run_id"]
    assert client.get_registered_model(MODEL).description.startswith("Trained by hetflow: the float model")
    assert client.get_registered_model(f"{MODEL}-tflite").description.startswith("Trained by hetflow: the TFLite")
    assert float(champion.tags["test_accuracy"]) == pytest.approx(summary["metrics"]["test_accuracy"], abs=1e-6)

    dataset = DatasetRecord.read(RunPaths(Path(summary["run_dir"])))
    images, labels = split_arrays(dataset, "test")
    model = mlflow.pyfunc.load_model(f"models:/{MODEL}@champion")
    logits = np.asarray(model.predict(images))
    accuracy = float(np.mean(np.argmax(logits, axis=1) == labels))
    assert accuracy == pytest.approx(summary["metrics"]["test_accuracy"], abs=1e-9)


def test_a_retried_register_task_makes_no_second_run_or_version(first, client):
    from hetflow.tasks.register import register

    _, summary = first
    again = register(summary["run_id"], "hetflow_train")
    assert again["version"] == 1 and again["mlflow_run_id"] == summary["mlflow_run_id"]
    assert len(client.search_model_versions(f"name='{MODEL}'")) >= 1
    for name in (MODEL, f"{MODEL}-tflite"):
        versions = client.search_model_versions(f"name='{name}' and run_id='{summary['mlflow_run_id']}'")
        assert [int(v.version) for v in versions] == [1]
    assert len(client.get_metric_history(summary["mlflow_run_id"], "train_loss")) == 15


def test_second_run_reuses_data_and_does_not_take_champion_below_the_gate(first, second, client):
    _, first_summary = first
    done, summary = second
    assert done.returncode == 0, done.stderr[-3000:]
    dataset = DatasetRecord.read(RunPaths(Path(summary["run_dir"])))
    assert dataset.reused and dataset.fingerprint == first_summary["dataset"]["fingerprint"]
    assert summary["mlflow_run_id"] != first_summary["mlflow_run_id"]
    assert summary["registry"]["version"] == 2
    assert summary["registry"]["aliases"] == ["candidate"] and not summary["registry"]["promoted"]
    assert "does not beat champion v1" in summary["registry"]["gate"]
    assert int(client.get_model_version_by_alias(MODEL, "champion").version) == 1
    assert int(client.get_model_version_by_alias(MODEL, "candidate").version) == 2
    tflite = summary["registry"]["models"][1]
    assert tflite["version"] == 2 and tflite["aliases"] == ["candidate"]
    assert int(client.get_model_version_by_alias(f"{MODEL}-tflite", "champion").version) == 1


def test_a_failing_stage_fails_the_run_and_says_where(hetflow_env, second, client):
    done, summary = run_dag(hetflow_env, "epochs=1000", "train_timeout_seconds=10")
    assert done.returncode == 1
    assert summary["status"] == "failed" and summary["failed_stage"] == "train"
    assert "training timed out after 10 s (train_timeout_seconds)" in done.stdout + done.stderr
    assert len(client.search_model_versions(f"name='{MODEL}'")) == 2
    (failed,) = client.search_runs(
        [client.get_experiment_by_name("hetflow").experiment_id], f"tags.`airflow.run_id` = '{summary['run_id']}'"
    )
    assert failed.info.status == "FAILED" and failed.data.tags["failed_task"] == "train"
    assert "training timed out after 10 s" in failed.data.tags["failure_reason"]


_RESCORE = """
import json, sys
import numpy as np
import hetflow
from hetflow.data.pipeline import split_arrays
from hetflow.artifacts.predictors import saved_model_predictor, tflite_predictor
from pathlib import Path
from hetflow.records import DatasetRecord
exported = json.loads(Path(sys.argv[1]).read_text())
dataset = DatasetRecord.model_validate_json(Path(sys.argv[2]).read_text())
images, labels = split_arrays(dataset, "test")
import tensorflow as tf
assert [d.name for d in tf.config.list_logical_devices()] == ["/device:CPU:0"]  # one device, no cluster
scores = {}
for name, artifact in exported["artifacts"].items():
    load = saved_model_predictor if artifact["format"] == "saved_model" else tflite_predictor
    scores[name] = float(np.mean(np.argmax(load(Path(artifact["path"]))(images), axis=1) == labels))
print(json.dumps(scores))
"""


def _rescored(run_dir: Path, env: dict[str, str]) -> dict[str, float]:
    """Each exported artifact's test accuracy, scored again in a fresh process with one CPU device."""
    import subprocess
    import sys

    from conftest import REPO

    done = subprocess.run(
        [sys.executable, "-c", _RESCORE, str(run_dir / "export.json"), str(run_dir / "dataset.json")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_exported_artifact_rescored_in_a_fresh_process_matches_the_report(first, hetflow_env):
    _, summary = first
    run_dir = Path(summary["run_dir"])
    exported = json.loads((run_dir / "export.json").read_text())
    assert set(exported["artifacts"]) == {
        "saved_model",
        "tflite_float",
        "tflite_pruned",
        "tflite_float_int8",
        "tflite_pruned_int8",
    }
    rescored = _rescored(run_dir, hetflow_env)
    for name, artifact in exported["artifacts"].items():
        assert rescored[name] == pytest.approx(artifact["test_accuracy"], abs=1e-9), name
    assert exported["artifacts"]["saved_model"]["test_accuracy"] == summary["metrics"]["test_accuracy"]
    # int8 stores each weight in one byte where float needs four; the metadata (about 1 KB in every file,
    # the same in both) is left out so that the comparison is of the weights alone.
    int8, float32 = (
        _constant_bytes(Path(exported["artifacts"][n]["path"])) for n in ("tflite_float_int8", "tflite_float")
    )
    assert int8 < 0.3 * float32


def _constant_bytes(tflite_file: Path) -> int:
    """The bytes of a TFLite file's constant tensors: every buffer but those its metadata entries name."""
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromPackedBuf(tflite_file.read_bytes(), 0)
    metadata_buffers = {entry.buffer for entry in model.metadata or []}
    return sum(
        len(buffer.data)
        for i, buffer in enumerate(model.buffers)
        if i not in metadata_buffers and buffer.data is not None
    )


def test_a_model_trained_on_two_stage_replicas_is_one_ordinary_model(second, hetflow_env):
    _, summary = second
    run_dir = Path(summary["run_dir"])
    training = json.loads((run_dir / "replica_output" / "training.json").read_text())
    stages = training["per_worker"]
    layers = [entry["layer"] for entry in training["layer_placement"]]
    assert stages["worker-0"]["layers"] + stages["worker-1"]["layers"] == layers and all(
        stage["layers"] for stage in stages.values()
    )
    # The MLP on 8x8 digits: 64 -> 128 -> 10, float32; Adam keeps two slots per variable, beside it.
    assert sum(stage["variable_bytes"] for stage in stages.values()) == 4 * (64 * 128 + 128 + 128 * 10 + 10)
    assert all(stage["slot_bytes"] == 2 * stage["variable_bytes"] for stage in stages.values())
    # The split, recomputed by the pipeline from the chief's measurements (plan.json), in the summary.
    split = summary["stage_split"]
    assert split["method"] == "measured"
    assert [(s["replica"], s["layers"]) for s in split["stages"]] == [(n, stages[n]["layers"]) for n in sorted(stages)]
    assert split["slowest_stage_seconds"] <= split["slowest_by_parameters_seconds"]
    exported = json.loads((run_dir / "export.json").read_text())
    saved_model = Path(exported["artifacts"]["saved_model"]["path"])
    assert b"/job:worker" not in (saved_model / "saved_model.pb").read_bytes()  # no stage's device baked in
    rescored = _rescored(run_dir, hetflow_env)
    for name, artifact in exported["artifacts"].items():
        assert rescored[name] == pytest.approx(artifact["test_accuracy"], abs=1e-9), name
    assert exported["artifacts"]["saved_model"]["test_accuracy"] == summary["metrics"]["test_accuracy"] > 0.5


def test_pruning_reaches_the_target_sparsity(first):
    _, summary = first
    compression = json.loads((Path(summary["run_dir"]) / "compression.json").read_text())
    assert compression["target_sparsity"] == 0.5
    pruned = compression["pruned_layers"]
    assert pruned and all(compression["kernel_sparsity"][name] == pytest.approx(0.5, abs=0.01) for name in pruned)


def test_chosen_tflite_variant_is_registered_and_its_champion_predicts(first, client):
    import mlflow
    from hetflow.data.pipeline import split_arrays

    _, summary = first
    exported = json.loads((Path(summary["run_dir"]) / "export.json").read_text())
    chosen = exported["artifacts"][summary["artifacts"]["chosen_tflite"]]
    assert chosen["accepted"]
    tflite = summary["registry"]["models"][1]
    assert tflite["model_name"] == f"{MODEL}-tflite" and tflite["aliases"] == ["candidate", "champion"]
    version = client.get_model_version_by_alias(f"{MODEL}-tflite", "champion")
    assert version.tags["variant"] == chosen["variant"] and version.tags["quantize"] == chosen["quantize"]
    assert int(version.tags["size_bytes"]) == chosen["bytes"]
    assert version.tags["dataset.fingerprint"] == summary["dataset"]["fingerprint"]
    assert "test accuracy" in version.description and "gate: no champion yet" in version.description

    dataset = DatasetRecord.read(RunPaths(Path(summary["run_dir"])))
    images, labels = split_arrays(dataset, "test")
    model = mlflow.pyfunc.load_model(f"models:/{MODEL}-tflite@champion")
    accuracy = float(np.mean(np.argmax(np.asarray(model.predict(images)), axis=1) == labels))
    assert accuracy == pytest.approx(chosen["test_accuracy"], abs=1e-9)

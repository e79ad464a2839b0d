"""Infra validation: registered models served by MLflow's model server, queried over HTTP, before promotion."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import hetflow, listening

from hetflow.paths import RunPaths
from hetflow.records import DatasetRecord

pytestmark = pytest.mark.slow

MODEL = "serve-digits"


@pytest.fixture(scope="module")
def run(hetflow_env) -> dict:
    done = hetflow(hetflow_env, "run", "--set", f"registered_model={MODEL}", "--set", "epochs=3")
    summary_path = Path(done.stdout.strip().splitlines()[-1])
    assert summary_path.name == "summary.json", done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "success", done.stdout[-3000:] + done.stderr[-3000:]
    return summary


@pytest.fixture(scope="module")
def client(hetflow_env):
    from mlflow import MlflowClient

    return MlflowClient(hetflow_env["MLFLOW_TRACKING_URI"])


@pytest.fixture(scope="module")
def test_images(run) -> tuple[np.ndarray, np.ndarray]:
    from hetflow.data.pipeline import split_arrays

    return split_arrays(DatasetRecord.read(RunPaths(Path(run["run_dir"]))), "test")


def _server_gone(check: dict) -> bool:
    from hetflow.cluster.processes import group_members

    return group_members(check["pgid"]) == [] and not listening(f"127.0.0.1:{check['port']}")


def test_a_good_run_serves_both_models_with_agreement_1_and_promotes_them(run, client):
    exported = json.loads((Path(run["run_dir"]) / "export.json").read_text())
    float_model, tflite_model = run["registry"]["models"]
    assert [float_model["model_name"], tflite_model["model_name"]] == [MODEL, f"{MODEL}-tflite"]
    for kind, model in (("float", float_model), ("tflite", tflite_model)):
        served = model["served"]
        assert model["promoted"] and model["aliases"] == ["candidate", "champion"]
        assert served["passed"] and served["agreement"] == 1.0 and served["examples"] == 256
        assert served["isolation"]["confined"] is True
        assert served["max_logit_difference"] <= 1e-3
        assert served["latency_requests"] >= 100 and 0 < served["latency_p50_ms"] <= served["latency_p99_ms"]
        assert 0 < served["start_seconds"] < served["seconds"]
        assert _server_gone(served)

        run_record = client.get_run(run["mlflow_run_id"]).data
        assert run_record.metrics[f"served_{kind}_agreement"] == 1.0
        assert run_record.metrics[f"served_{kind}_latency_p99_ms"] == served["latency_p99_ms"]
        assert run_record.tags[f"served.{kind}"].startswith("passed: MLflow's model server up in")

        description = client.get_model_version(model["model_name"], str(model["version"])).description
        assert f"fingerprint `{run['dataset']['fingerprint']}`" in description
        assert "- test accuracy: " in description and " vs no champion yet" in description
        assert "- served check: passed: " in description and "agreement 1.0000" in description
        assert "- gate: no champion yet" in description
        assert description.startswith("Test accuracy ") and ": champion. Served check passed.\n" in description
        # What a reviewer reads in the version's tags: the check's sentence, not its record.
        tags = client.get_model_version(model["model_name"], str(model["version"])).tags
        assert tags["served"].startswith("passed: MLflow's model server up in") and "pgid" not in tags["served"]
        for name, artifact in exported["artifacts"].items():  # the compression table, one row per artifact
            row = rf"^{name} +{artifact['bytes']} +{artifact['gzip_bytes']} +{artifact['test_accuracy']:.4f} "
            assert re.search(row, description, re.MULTILINE), description
    artifacts = {a.path for a in client.list_artifacts(run["mlflow_run_id"], "serving")}
    # Each server's log, and each check's figures (a retried register task reads them back).
    logged = {
        f"serving/{name}-v1{suffix}" for name in (MODEL, f"{MODEL}-tflite") for suffix in (".log", ".served.json")
    }
    assert artifacts == logged


_LOAD_CHAMPIONS = """
import json, os, sys
import numpy as np
import mlflow
images = np.load(sys.argv[1])
logits = {name: np.asarray(mlflow.pyfunc.load_model(f"models:/{name}@champion").predict(images)).tolist()
          for name in sys.argv[2:]}
assert "TF_USE_LEGACY_KERAS" not in os.environ and "hetflow" not in sys.modules
print(json.dumps(logits))
"""


def test_the_champions_load_and_predict_in_a_clean_process_that_never_imported_hetflow(
    run, hetflow_env, test_images, tmp_path
):
    from hetflow.artifacts.predictors import saved_model_predictor, tflite_predictor

    images, _ = test_images
    np.save(tmp_path / "images.npy", images)
    exported = json.loads((Path(run["run_dir"]) / "export.json").read_text())
    clean = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "MLFLOW_TRACKING_URI": hetflow_env["MLFLOW_TRACKING_URI"],
    }
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_CHAMPIONS, str(tmp_path / "images.npy"), MODEL, f"{MODEL}-tflite"],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    logits = json.loads(done.stdout.strip().splitlines()[-1])
    saved_model = saved_model_predictor(Path(exported["artifacts"]["saved_model"]["path"]))(images)
    tflite = tflite_predictor(Path(exported["artifacts"][exported["chosen_tflite"]]["path"]))(images)
    np.testing.assert_allclose(np.asarray(logits[MODEL]), saved_model, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits[f"{MODEL}-tflite"]), tflite, atol=1e-6)


def test_a_champion_scored_on_other_data_is_served_not_loaded(run, client, hetflow_env, tmp_path):
    from hetflow.registry.champion import champion_accuracy

    champion = client.get_model_version_by_alias(MODEL, "champion")
    dataset = DatasetRecord.read(RunPaths(Path(run["run_dir"]))).model_copy(update={"fingerprint": "other data"})
    # A recorded accuracy for other data does not count: the value comes from the served model.
    client.set_model_version_tag(MODEL, champion.version, "test_accuracy", "0.123")
    try:
        score = champion_accuracy(
            client.get_model_version(MODEL, champion.version), dataset, tmp_path, hetflow_env["MLFLOW_TRACKING_URI"]
        )
    finally:
        client.set_model_version_tag(MODEL, champion.version, "test_accuracy", champion.tags["test_accuracy"])
    assert score == pytest.approx(run["metrics"]["test_accuracy"], abs=1e-9)
    assert (tmp_path / f"{MODEL}-v{champion.version}-champion.log").exists()


def _reversed_saver(saved_model: Path, images: np.ndarray, predict):
    """A deliberately broken model: serving_default's logits with the classes in reverse order
    (versions.saved_model_saver's stand-in; ``predict``, the exported model's logits, is unused)."""

    def save(path: Path, mlflow_model, registered_version: str) -> dict[str, str]:
        import tensorflow as tf

        import mlflow

        exported = tf.saved_model.load(str(saved_model))
        serve = exported.signatures["serving_default"]

        class Reversed(tf.Module):
            def __init__(self):
                super().__init__()
                self.exported = exported
                self.__call__ = tf.function(
                    lambda image: tf.reverse(serve(image=image)["logits"], axis=[1]),
                    input_signature=[serve.structured_input_signature[1]["image"]],
                )

        from mlflow.models import infer_signature

        signature = infer_signature(images[:5], np.zeros((5, 10), np.float32))
        mlflow.tensorflow.save_model(
            Reversed(), str(path), mlflow_model=mlflow_model, signature=signature, pip_requirements=["tensorflow"]
        )
        return {}

    return save


def test_a_served_model_that_disagrees_is_not_promoted_and_its_server_is_gone(run, client, monkeypatch, tmp_path):
    from hetflow.paths import RunPaths
    from hetflow.pipeline.attempts import load_spec
    from hetflow.registry import versions
    from hetflow.spec import RunSpec
    from hetflow.tasks.register import register_model

    paths = RunPaths(tmp_path / "run")
    shutil.copytree(run["run_dir"], paths.root)
    # min_improvement 0: the same accuracy as the champion passes the accuracy gate, so only the
    # served check can stop the float model.
    spec = RunSpec.from_values({**load_spec(paths).flat(), "min_improvement": 0.0})
    monkeypatch.setattr(versions, "saved_model_saver", _reversed_saver)
    record = register_model(spec, paths, DatasetRecord.read(paths), "hetflow_train", "broken")

    float_model, tflite_model = record["models"]
    served = float_model["served"]
    assert not served["passed"] and served["agreement"] == 0.0
    assert not float_model["promoted"] and float_model["aliases"] == ["candidate"]
    assert float_model["gate"].startswith("served check failed: served predictions disagree with the exported model")
    assert int(client.get_model_version_by_alias(MODEL, "champion").version) == 1
    assert _server_gone(served)
    run_record = client.get_run(record["mlflow_run_id"]).data
    assert run_record.metrics["served_float_passed"] == 0.0 and run_record.metrics["served_float_agreement"] == 0.0
    assert run_record.tags["served.float"].startswith("failed: served predictions disagree")
    description = client.get_model_version(MODEL, str(float_model["version"])).description
    assert "- served check: failed: served predictions disagree" in description
    assert "- gate: served check failed: " in description
    # The TFLite model of the same run serves correctly and, at min_improvement 0, is promoted.
    assert tflite_model["served"]["passed"] and tflite_model["promoted"] and _server_gone(tflite_model["served"])


def test_a_server_that_cannot_start_is_not_passed_and_leaves_nothing(hetflow_env, tmp_path):
    from hetflow.serving.server import served_check

    images = np.zeros((4, 8, 8, 1), np.uint8)
    check = served_check(
        f"models:/{MODEL}/999", hetflow_env["MLFLOW_TRACKING_URI"], images, np.zeros((4, 10)), tmp_path / "s.log"
    )
    assert not check["passed"] and "999" in check["reason"]  # the registry's own error
    if check["isolation"]["confined"]:  # the pipeline copies the version for the server: nothing to copy
        assert check["reason"].startswith(f"could not copy models:/{MODEL}/999 from the registry: ")
        assert "pgid" not in check  # no server was started
    else:  # the server reads the registry itself, and fails
        assert check["reason"].startswith("server exited with code 1 before it was healthy")
        assert _server_gone(check)


def test_a_server_not_healthy_by_its_deadline_is_stopped(run, hetflow_env, tmp_path):
    from hetflow.serving.server import served_check

    images = np.zeros((4, 8, 8, 1), np.uint8)
    uri, tracking = f"models:/{MODEL}/1", hetflow_env["MLFLOW_TRACKING_URI"]
    check = served_check(uri, tracking, images, np.zeros((4, 10)), tmp_path / "s.log", deadline_seconds=2)
    assert not check["passed"] and check["reason"].startswith("server not healthy by its deadline")
    assert check["seconds"] < 2 + 16  # the deadline, then at most the stop's grace and SIGKILL wait
    assert _server_gone(check)


_SERVE_AND_WAIT = """
import sys, time
from hetflow.serving.server import ModelServer
server = ModelServer(sys.argv[1], sys.argv[2], __import__("pathlib").Path(sys.argv[3]))
server.__enter__()
print(server.process.pid, server.port, flush=True)
time.sleep(600)
"""


def test_a_server_whose_starter_is_killed_is_ended_with_everything_it_started(run, hetflow_env, tmp_path):
    """SIGKILL of the process that started the server (Airflow's second signal to the register task)
    leaves no chance to stop it: the sandbox dies with its starter (bwrap's --die-with-parent)."""
    import os
    import signal

    from conftest import REPO, wait_for

    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _SERVE_AND_WAIT,
            f"models:/{MODEL}/1",
            hetflow_env["MLFLOW_TRACKING_URI"],
            str(tmp_path / "s.log"),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    pgid, port = (int(field) for field in starter.stdout.readline().split())
    from hetflow.cluster.processes import group_members

    # bwrap and the server, which listens in the sandbox's own network: none of this host's ports.
    assert len(group_members(pgid)) >= 2 and not listening(f"127.0.0.1:{port}")
    os.kill(starter.pid, signal.SIGKILL)
    starter.wait()
    assert wait_for(lambda: _server_gone({"pgid": pgid, "port": port}), timeout=30)


def test_the_server_environment_is_a_users_not_the_pipelines(monkeypatch):
    from hetflow.serving.server import scoring_command
    from hetflow.serving.server_process import server_environment

    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "a-registry-secret")
    env = server_environment()
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert not {"TF_USE_LEGACY_KERAS", "PYTHONPATH", "HETFLOW_HOME", "AIRFLOW_HOME", "MLFLOW_TRACKING_TOKEN"} & set(env)
    # MLflow's own serving command, run from the venv, told which folder to serve and nothing else of ours.
    command, added = scoring_command(Path("/served/model"), 5001)
    assert Path(command[0]).parent == Path(sys.executable).parent and Path(command[0]).exists()
    assert command[-1] == "mlflow.pyfunc.scoring_server.app:app" and "5001" in command
    assert "/served/model" in " ".join(added.values())
    assert not {"TF_USE_LEGACY_KERAS", "PYTHONPATH", "MLFLOW_TRACKING_TOKEN"} & set(added)


def test_the_served_copy_of_a_version_is_not_readable_by_other_local_users(hetflow_env, tmp_path):
    """While its server runs, the copy of a registered version the pipeline downloaded for it is its
    owner's only: another local user can neither list it nor read a file of it."""
    import os
    import stat

    from hetflow.registry.store import ensure_experiment
    from hetflow.serving.server import ModelServer
    from mlflow import MlflowClient

    model = tmp_path / "model"
    model.mkdir()
    (model / "MLmodel").write_text("flavors:\n  python_function:\n    loader_module: mlflow.pyfunc.model\n")
    (model / "weights.bin").write_bytes(b"the registry's weights")
    client = MlflowClient()
    run_id = client.create_run(ensure_experiment(client)).info.run_id  # artifacts beside the test's store
    client.log_artifacts(run_id, str(model), "model")
    client.create_registered_model("served-copy")
    version = client.create_model_version("served-copy", f"runs:/{run_id}/model", run_id=run_id).version
    server = ModelServer(f"models:/served-copy/{version}", hetflow_env["MLFLOW_TRACKING_URI"], tmp_path / "s.log")
    try:
        server.start()
        [weights] = server._copy.rglob("weights.bin")
        assert stat.S_IMODE(server._copy.stat().st_mode) == 0o700
        if os.geteuid() == 0:  # another local user tries to read it
            for command in (["ls", str(server._copy)], ["cat", str(weights)]):
                other = ["setpriv", "--reuid=12345", "--regid=12345", "--clear-groups", *command]
                tried = subprocess.run(other, capture_output=True, text=True)
                assert tried.returncode != 0 and "Permission denied" in tried.stderr, tried
    finally:
        server.stop()

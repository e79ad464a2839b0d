"""hetflow_retrain's spec comes from the registry, which whoever can register a model writes: it
takes the champion's training recipe only, never where data is read from, where replicas run,
which model is promoted or the gate's thresholds. A real MLflow store and registry."""

from __future__ import annotations

import json
import logging


def test_a_retrain_takes_only_the_champions_recipe(hetflow_env, tmp_path, caplog):
    from hetflow.registry.champion import CHAMPION
    from hetflow.registry.retrain import retrain_spec
    from hetflow.spec import RunSpec
    from mlflow import MlflowClient

    client = MlflowClient(hetflow_env["MLFLOW_TRACKING_URI"])
    # Its artifacts under the test's directory, not MLflow's default ./mlruns in the working directory.
    experiment = client.get_experiment_by_name("retrain") or client.get_experiment(
        client.create_experiment("retrain", artifact_location=(tmp_path / "artifacts").as_uri())
    )
    run = client.create_run(experiment.experiment_id)
    # What a registry writer recorded as the champion's spec: a recipe, and keys that are not its.
    recorded = {
        "epochs": 3,
        "learning_rate": 0.05,
        "model": "cnn",
        "data_dir": "/etc",
        "backend": "docker",
        "image": "attacker/replica:latest",
        "registered_model": "someone-elses-model",
        "min_improvement": -1.0,
        "max_accuracy_drop": 1.0,
        "train_timeout_seconds": 604800,
    }
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(recorded))
    client.log_artifact(run.info.run_id, str(spec_file), "run")
    client.create_registered_model("retrained")
    version = client.create_model_version("retrained", f"runs:/{run.info.run_id}/run", run_id=run.info.run_id)
    client.set_registered_model_alias("retrained", CHAMPION, version.version)

    with caplog.at_level(logging.INFO, logger="hetflow.retrain"):
        spec = retrain_spec("retrained", {"epochs": 5})
    defaults = RunSpec().flat()
    assert spec["epochs"] == 5  # the DAG's override wins
    assert spec["learning_rate"] == 0.05 and spec["model"] == "cnn"  # the champion's recipe
    assert spec["registered_model"] == "retrained"
    for key in ("data_dir", "backend", "image", "min_improvement", "max_accuracy_drop", "train_timeout_seconds"):
        assert spec[key] == defaults[key], key
    assert (
        "not taken from the champion's recorded spec (the DAG's to choose): backend, data_dir, image, "
        "max_accuracy_drop, min_improvement, registered_model, train_timeout_seconds" in caplog.text
    )

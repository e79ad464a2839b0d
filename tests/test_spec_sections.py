"""RunSpec in sections: every key reached by its short name and by its path, a spec.json written flat
(before the sections) or nested read alike, and the flat views (MLflow params, the training key)
unchanged by the sections."""

from __future__ import annotations

import functools
import json

import pytest
from conftest import hetflow

from hetflow.spec import KEYS, RunSpec, SpecError, parse_assignment, parse_spec

# short name -> (path, a value other than the default). Written out by hand: the table users rely on.
PATHS = {
    "dataset": ("data.dataset", "mnist"),
    "data_dir": ("data.data_dir", "/data"),
    "image_size": ("data.image_size", "28x28"),
    "skip_unchanged": ("data.skip_unchanged", False),
    "model": ("model.architecture", "cnn"),
    "strategy": ("cluster.strategy", "parameter_server"),
    "backend": ("cluster.backend", "docker"),
    "workers": ("cluster.worker.replicas", 3),
    "devices_per_worker": ("cluster.worker.devices", 2),
    "worker_devices": (
        "cluster.worker.each",
        [{"device": "gpu", "count": 2, "threads": 0, "slowdown": 1.0, "node": None}],
    ),
    "balance_batches": ("cluster.worker.balance_batches", True),
    "ps": ("cluster.ps.replicas", 2),
    "replica_threads": ("cluster.replica_threads", 4),
    "pin_cores": ("cluster.pin_cores", True),
    "restart_policy": ("cluster.run_policy.restart_policy", "on_failure"),
    "backoff_limit": ("cluster.run_policy.backoff_limit", 5),
    "train_timeout_seconds": ("cluster.run_policy.timeout_seconds", 600),
    "image": ("cluster.image", "registry.example/replica:2"),
    "replica_cpus": ("cluster.resources.cpus", 1.5),
    "replica_memory_mb": ("cluster.resources.memory_mb", 512),
    "request_gpus": ("cluster.resources.request_gpus", True),
    "encrypt_network": ("cluster.swarm.encrypt_network", False),
    "kubernetes_namespace": ("cluster.kubernetes.namespace", "training"),
    "kubernetes_volume_claim": ("cluster.kubernetes.volume_claim", "claim-2"),
    "epochs": ("training.epochs", 7),
    "steps_per_epoch": ("training.steps_per_epoch", 11),
    "batch_size": ("training.batch_size", 64),
    "learning_rate": ("training.learning_rate", 0.05),
    "target_accuracy": ("training.target_accuracy", 0.9),
    "lr_scaling": ("training.lr_scaling", "linear"),
    "lr_reference_batch": ("training.lr_reference_batch", 128),
    "warmup_epochs": ("training.warmup_epochs", 1.5),
    "optimizer": ("training.optimizer", "sgd"),
    "shuffle": ("training.shuffle", False),
    "shuffle_buffer": ("training.shuffle_buffer", 512),
    "cache_budget_mb": ("training.cache_budget_mb", 0),
    "seed": ("training.seed", 7),
    "checkpoint_every": ("training.checkpoint_every", 3),
    "prune": ("compression.prune", False),
    "target_sparsity": ("compression.target_sparsity", 0.8),
    "fine_tuning_share": ("compression.fine_tuning_share", 2.0),
    "quantize": ("compression.quantize", "float16"),
    "calibration_examples": ("compression.calibration_examples", 400),
    "max_accuracy_drop": ("export.max_accuracy_drop", 0.05),
    "export_formats": ("export.formats", ["tflite"]),
    "registered_model": ("registry.model_name", "other-model"),
    "min_improvement": ("registry.min_improvement", 0.01),
    "micro_batches": ("cluster.micro_batches", 8),
    "stage_split": ("cluster.stage_split", "parameters"),
}


def at(spec: RunSpec, path: str):
    value = functools.reduce(getattr, path.split("."), spec)
    return [item.model_dump() for item in value] if path == "cluster.worker.each" else value


def test_the_table_names_every_key_once():
    assert sorted(PATHS) == sorted(key.short for key in KEYS)
    assert sorted(path for path, _ in PATHS.values()) == sorted(key.dotted for key in KEYS)


@pytest.mark.parametrize("short", PATHS)
@pytest.mark.parametrize("by", ["short name", "path"])
def test_set_reaches_every_key_by_its_short_name_and_by_its_path(short, by):
    path, value = PATHS[short]
    name = short if by == "short name" else path
    spec = RunSpec.from_values(dict([parse_assignment(f"{name}={json.dumps(value)}")]))
    assert at(spec, path) == value
    assert spec.flat(mode="json")[short] == value  # MLflow params and the conf keep the short name
    assert at(RunSpec(), path) != value


def test_a_section_given_as_an_object_and_later_values_winning():
    spec = RunSpec.from_values({"cluster": {"worker": {"replicas": 2}, "strategy": "multi_worker_mirrored"}})
    assert (spec.cluster.worker.replicas, spec.cluster.strategy) == (2, "multi_worker_mirrored")
    # The DAG validates {**params, **conf}: the form's value by short name, then the conf's by path.
    assert RunSpec.from_values({"epochs": 40, "training.epochs": 5}).training.epochs == 5
    assert RunSpec.from_values({"training.epochs": 5, "epochs": 40}).training.epochs == 40


def test_a_problem_given_by_path_is_told_by_the_short_name():
    with pytest.raises(SpecError) as caught:
        parse_spec({"cluster.worker.replicas": 0, "cluster": {"worker": {"each": [{"slowdown": 0.5}]}}})
    assert caught.value.problems == [
        "workers=0 is invalid: expected an integer >= 1 and <= 16",
        "worker_devices[0].slowdown=0.5 is invalid: input should be greater than or equal to 1",
    ]
    with pytest.raises(SpecError) as caught:
        parse_spec({"cluster.worker.replica": 2, "cluster": {"wrker": {}}})
    assert caught.value.problems[0].startswith(
        "unknown key 'cluster.worker.replica'=2 (did you mean 'cluster.worker.replicas'?); allowed keys: dataset,"
    )
    assert caught.value.problems[1].startswith("unknown key 'cluster.wrker'={}")


# A spec.json as validate_spec wrote it before the sections (every key flat).
FLAT_RECORD = {
    "dataset": "mnist", "data_dir": None, "image_size": None, "skip_unchanged": True, "model": "mlp",
    "strategy": "multi_worker_mirrored", "backend": "docker", "workers": 2, "ps": 0, "devices_per_worker": 1,
    "worker_devices": [
        {"device": "cpu", "count": 1, "threads": 1, "slowdown": 1.0, "node": None},
        {"device": "cpu", "count": 1, "threads": 0, "slowdown": 2.0, "node": None},
    ],
    "balance_batches": False, "replica_threads": 0, "pin_cores": False, "restart_policy": "never",
    "backoff_limit": 3, "train_timeout_seconds": 3600, "image": "hetflow-replica:0.1.0", "replica_cpus": 1.5,
    "replica_memory_mb": 0, "request_gpus": False, "encrypt_network": True, "kubernetes_namespace": "default",
    "kubernetes_volume_claim": "hetflow-home", "epochs": 40, "steps_per_epoch": 5, "batch_size": 32,
    "learning_rate": 0.001, "target_accuracy": None, "lr_scaling": "none", "lr_reference_batch": 32,
    "warmup_epochs": 0.0, "optimizer": "adam", "shuffle": True, "seed": 42, "checkpoint_every": 1, "prune": True,
    "target_sparsity": 0.5, "fine_tuning_share": 0.75, "quantize": "dynamic", "max_accuracy_drop": 0.01,
    "export_formats": ["tflite"], "registered_model": "m1", "min_improvement": 0.001,
}  # fmt: skip


def test_a_flat_and_a_nested_spec_json_load_alike(tmp_path):
    flat = RunSpec.from_json(json.dumps(FLAT_RECORD))
    nested_text = flat.model_dump_json()
    assert json.loads(nested_text)["cluster"]["worker"]["replicas"] == 2  # written in sections
    assert RunSpec.from_json(nested_text) == flat
    assert flat.cluster.worker.each[1].slowdown == 2.0 and flat.cluster.resources.cpus == 1.5
    # MLflow params: the same names and values as before, and a key added since at its default
    added = {
        "micro_batches": 1,
        "stage_split": "measured",
        "calibration_examples": 200,
        "shuffle_buffer": 10_000,
        "cache_budget_mb": 512,
    }
    assert flat.flat(mode="json") == {**FLAT_RECORD, **added}


def test_the_training_key_is_the_one_recorded_before_the_sections():
    from hetflow.registry.training_key import training_key

    # Computed by the flat RunSpec (bee1ed4): versions trained before the sections are still recognised.
    # Its fine_tuning_share default was 0.75; compress's recovery rule made it 1.5, the longest the
    # fine-tuning may run, so a spec leaving it unset names a new training since (its compressed files
    # differ), and one that sets 0.75 names the training it always did.
    before = {"fine_tuning_share": 0.75}
    assert (
        training_key(parse_spec(before), "0" * 64) == "c0922d40bf2de3c50c9e3b4063858bc6248f350853fc21d6e733a2515026f3d0"
    )
    assert (
        training_key(parse_spec({**before, "strategy": "multi_worker_mirrored", "workers": 2, "epochs": 5}), "ab" * 32)
        == "56021cbdac511ebe8818561fe9600ef7c489390448e2786e320e9c45b91b396a"
    )
    assert training_key(parse_spec({}), "0" * 64) != training_key(parse_spec(before), "0" * 64)
    assert (
        training_key(RunSpec.from_values(FLAT_RECORD), "cd" * 32)
        == "04b32342542206b4f193f4faff0467112e9f8937f4b637dd9a3029beb729538b"
    )
    staged = {"strategy": "model_parallel", "workers": 2}
    assert training_key(parse_spec(staged), "0" * 64) != training_key(
        parse_spec({**staged, "micro_batches": 8}), "0" * 64
    )


def test_cli_validate_takes_paths_and_sections_and_prints_the_sections(hetflow_env, tmp_path):
    config = tmp_path / "spec.json"
    config.write_text(json.dumps({"cluster": {"strategy": "multi_worker_mirrored"}, "model": "cnn"}))
    done = hetflow(hetflow_env, "validate", "--config", str(config), "--set", "cluster.worker.replicas=2")
    assert done.returncode == 0, done.stderr
    spec = json.loads(done.stdout)
    assert spec["cluster"]["worker"]["replicas"] == 2 and spec["cluster"]["strategy"] == "multi_worker_mirrored"
    assert spec["model"] == {"architecture": "cnn"}


@pytest.mark.parametrize("written", ["flat, before the sections", "in sections"])
def test_a_retrain_takes_the_recipe_of_a_champion_recorded_flat_or_in_sections(written, hetflow_env, tmp_path):
    from hetflow.registry.champion import CHAMPION
    from hetflow.registry.retrain import retrain_spec
    from mlflow import MlflowClient

    recorded = {**FLAT_RECORD, "epochs": 3, "learning_rate": 0.05, "data_dir": "/etc", "image": "attacker/x:1"}
    if written == "in sections":
        recorded = RunSpec.from_values(recorded).model_dump(mode="json")
    (tmp_path / "spec.json").write_text(json.dumps(recorded))
    client = MlflowClient(hetflow_env["MLFLOW_TRACKING_URI"])
    name = "champion-flat" if written.startswith("flat") else "champion-nested"
    experiment = client.create_experiment(name, artifact_location=(tmp_path / "artifacts").as_uri())
    run = client.create_run(experiment)
    client.log_artifact(run.info.run_id, str(tmp_path / "spec.json"), "run")
    client.create_registered_model(name)
    version = client.create_model_version(name, f"runs:/{run.info.run_id}/run", run_id=run.info.run_id)
    client.set_registered_model_alias(name, CHAMPION, version.version)

    spec = retrain_spec(name, {"cluster.worker.replicas": 2, "batch_size": 64})
    # hetflow_train's conf: flat, the champion's recipe, the DAG's choice of where data and replicas are.
    assert list(spec) == list(RunSpec().flat())
    assert (spec["epochs"], spec["learning_rate"], spec["quantize"], spec["export_formats"]) == (
        3,
        0.05,
        "dynamic",
        ["tflite"],
    )
    assert spec["worker_devices"] == FLAT_RECORD["worker_devices"] and spec["strategy"] == "multi_worker_mirrored"
    assert (spec["workers"], spec["batch_size"]) == (2, 64)  # the overrides, by path and by short name
    assert (spec["data_dir"], spec["image"], spec["backend"], spec["registered_model"]) == (
        None,
        "hetflow-replica:0.1.0",
        "local",
        name,
    )

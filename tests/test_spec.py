"""RunSpec: defaults, every invalid value rejected with one line, and the Params generated from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, hetflow

from hetflow.spec import KEYS, SPEC_KEYS, RunSpec, SpecError, airflow_params, parse_assignment, parse_spec


def test_defaults_are_valid():
    spec = parse_spec({})
    assert spec == RunSpec()
    assert (spec.data.dataset, spec.model.architecture, spec.cluster.strategy, spec.cluster.backend) == (
        "uci_digits",
        "mlp",
        "one_device",
        "local",
    )
    assert (spec.cluster.worker.replicas, spec.cluster.ps.replicas, spec.cluster.replicas_in_sync) == (1, 0, 1)


@pytest.mark.parametrize(
    "values",
    [
        {"strategy": "mirrored", "devices_per_worker": 2},
        {"strategy": "multi_worker_mirrored", "workers": 2, "devices_per_worker": 2, "batch_size": 64},
        {"strategy": "parameter_server", "workers": 2, "ps": 2},
        {"strategy": "model_parallel", "devices_per_worker": 2},
        {"strategy": "model_parallel", "model": "cnn", "workers": 3, "micro_batches": 8, "batch_size": 8},
    ],
)
def test_valid_cluster_shapes(values):
    assert parse_spec(values).cluster.strategy == values["strategy"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"epoch": 3}, "unknown key 'epoch'=3 (did you mean 'epochs'?); allowed keys: dataset,"),
        (
            {"strategy": "horovod"},
            'strategy="horovod" is invalid: expected one of auto, one_device, mirrored, multi_worker',
        ),
        ({"workers": 0}, "workers=0 is invalid: expected an integer >= 1 and <= 16"),
        ({"ps": -1}, "ps=-1 is invalid: expected an integer >= 0 and <= 8"),
        ({"lr_scaling": "sqrt"}, 'lr_scaling="sqrt" is invalid: expected one of none, linear'),
        ({"warmup_epochs": -1}, "warmup_epochs=-1 is invalid: expected a number >= 0 and <= 100"),
        ({"lr_reference_batch": 0}, "lr_reference_batch=0 is invalid: expected an integer >= 1 and <= 65536"),
        ({"strategy": "parameter_server"}, "ps=0 is invalid with strategy=parameter_server: expected an integer >= 1"),
        ({"ps": 1}, "ps=1 is invalid with strategy=one_device: expected 0 (parameter servers serve only"),
        ({"strategy": "multi_worker_mirrored", "ps": 2}, "ps=2 is invalid with strategy=multi_worker_mirrored"),
        ({"workers": 2}, "workers=2 is invalid with strategy=one_device: expected 1 (several workers need"),
        ({"strategy": "mirrored", "workers": 2}, "workers=2 is invalid with strategy=mirrored: expected 1"),
        (
            {"strategy": "multi_worker_mirrored", "workers": 3, "batch_size": 32},
            "batch_size=32 is invalid with 3 replicas in sync: expected a multiple of 3",
        ),
        (
            {"strategy": "multi_worker_mirrored", "workers": 2, "devices_per_worker": 2, "batch_size": 2},
            "batch_size=2 is invalid with 4 replicas in sync: expected a multiple of 4",
        ),
        (
            {"strategy": "parameter_server", "ps": 1, "shuffle": False},
            "shuffle=false is invalid with strategy=parameter_server: expected true",
        ),
        (
            {"strategy": "model_parallel"},
            "devices_per_worker=1 is invalid with strategy=model_parallel and workers=1: expected 2 or more",
        ),
        (
            {"strategy": "model_parallel", "workers": 2, "devices_per_worker": 2},
            "devices_per_worker=2 is invalid with strategy=model_parallel and workers=2: expected 1",
        ),
        (
            {"strategy": "model_parallel", "workers": 2, "worker_devices": [{"count": 1}, {"count": 2}]},
            "devices_per_worker=2 is invalid with strategy=model_parallel and workers=2: expected 1",
        ),
        (
            {"strategy": "model_parallel", "workers": 2, "micro_batches": 9, "batch_size": 8},
            "micro_batches=9 is invalid with batch_size=8: expected at most 8",
        ),
        ({"micro_batches": 8}, "micro_batches=8 is invalid with strategy=one_device: expected 1, the default"),
        ({"micro_batches": 0}, "micro_batches=0 is invalid: expected an integer >= 1 and <= 64"),
        (
            {"stage_split": "parameters"},
            "stage_split=parameters is invalid with strategy=one_device: expected measured",
        ),
        (
            {"strategy": "model_parallel", "workers": 5},
            "workers=5 is invalid with strategy=model_parallel and model=mlp: expected at most 2",
        ),
        (
            {"strategy": "model_parallel", "devices_per_worker": 5},
            "devices_per_worker=5 is invalid with strategy=model_parallel and model=mlp: expected at most 2",
        ),
        ({"devices_per_worker": 2}, "devices_per_worker=2 is invalid with strategy=one_device: expected 1"),
        ({"backend": "slurm"}, 'backend="slurm" is invalid: expected one of local'),
        ({"model": "resnet"}, 'model="resnet" is invalid: expected one of mlp, cnn, convnet'),
        ({"optimizer": "rmsprop"}, 'optimizer="rmsprop" is invalid: expected one of sgd, adam'),
        ({"epochs": 0}, "epochs=0 is invalid: expected an integer >= 1 and <= 1000"),
        ({"epochs": 2.5}, "epochs=2.5 is invalid: expected an integer >= 1 and <= 1000"),
        ({"epochs": "many"}, 'epochs="many" is invalid: expected an integer >= 1 and <= 1000'),
        ({"epochs": True}, "epochs=true is invalid: expected an integer >= 1 and <= 1000"),
        ({"learning_rate": True}, "learning_rate=true is invalid: expected a number > 0 and <= 10"),
        ({"steps_per_epoch": False}, "steps_per_epoch=false is invalid: expected an integer >= 1 and <= 100000"),
        ({"worker_devices": [{"count": True}]}, "worker_devices[0].count=true is invalid: expected a number, not"),
        ({"dataset": "mnist/.."}, 'dataset="mnist/.." is invalid: expected a string matching'),
        ({"dataset": "mnist/./x"}, 'dataset="mnist/./x" is invalid: expected a string matching'),
        ({"dataset": "mnist/.hidden"}, 'dataset="mnist/.hidden" is invalid: expected a string matching'),
        ({"learning_rate": 0}, "learning_rate=0 is invalid: expected a number > 0 and <= 10"),
        ({"learning_rate": -0.1}, "learning_rate=-0.1 is invalid: expected a number > 0 and <= 10"),
        ({"batch_size": 0}, "batch_size=0 is invalid: expected an integer >= 1 and <= 65536"),
        ({"steps_per_epoch": 0}, "steps_per_epoch=0 is invalid: expected an integer >= 1 and <= 100000, or empty"),
        ({"shuffle": "sometimes"}, 'shuffle="sometimes" is invalid: expected true or false'),
        ({"seed": -1}, "seed=-1 is invalid: expected an integer >= 0 and <= 2147483647"),
        ({"min_improvement": 2}, "min_improvement=2 is invalid: expected a number >= 0 and <= 1"),
        ({"dataset": "My Data"}, 'dataset="My Data" is invalid: expected a string matching'),
        ({"registered_model": "bad name!"}, 'registered_model="bad name!" is invalid: expected a string matching'),
    ],
)
def test_invalid_values_are_rejected_with_one_line_naming_key_value_and_allowed(values, message):
    with pytest.raises(SpecError) as caught:
        parse_spec(values)
    assert len(caught.value.problems) == 1
    assert caught.value.problems[0].startswith(message)
    assert "\n" not in caught.value.problems[0]


@pytest.mark.parametrize("dataset", ["mnist:3.0.1", "cifar10_corrupted/brightness_1", "c4/en.noblocklist:3.1.0"])
def test_tfds_names_with_a_config_and_a_version_are_valid(dataset):
    assert parse_spec({"dataset": dataset}).data.dataset == dataset


def test_every_problem_is_reported_at_once():
    with pytest.raises(SpecError) as caught:
        parse_spec({"epochs": 0, "model": "x", "nope": 1})
    assert len(caught.value.problems) == 3


def test_set_values_are_read_as_json_when_they_parse():
    assert parse_assignment("epochs=3") == ("epochs", 3)
    assert parse_assignment("learning_rate=1e-2") == ("learning_rate", 0.01)
    assert parse_assignment("shuffle=false") == ("shuffle", False)
    assert parse_assignment("steps_per_epoch=null") == ("steps_per_epoch", None)
    assert parse_assignment("model=cnn") == ("model", "cnn")
    with pytest.raises(SpecError, match="expected KEY=VALUE"):
        parse_assignment("epochs")


def test_params_are_generated_from_the_spec():
    params = airflow_params()
    assert tuple(params) == SPEC_KEYS
    for key, param in params.items():
        assert param.value == next(k for k in KEYS if k.short == key).field.default
        assert param.schema["description_md"], key
        assert next(k for k in KEYS if k.short == key).field.title, (
            f"{key} needs a title written for people (the form's label)"
        )
        assert param.schema["section"], key
    assert params["model"].schema["enum"] == ["mlp", "cnn", "convnet", "wide_mlp", "deep_mlp"]
    assert params["strategy"].schema["enum"] == [
        "auto",
        "one_device",
        "mirrored",
        "multi_worker_mirrored",
        "parameter_server",
        "model_parallel",
    ]
    # Top-level bounds would make the form's number input clamp what was typed (-1 became 1).
    assert not {"minimum", "maximum"} & {bound for param in params.values() for bound in param.schema}
    assert params["epochs"].schema["allOf"] == [{"minimum": 1, "maximum": 1000}]
    assert params["epochs"].schema["description_md"].endswith("Allowed: an integer >= 1 and <= 1000.")
    # Numbers are typed as text, so that what was typed reaches the server unchanged ("-" in a number
    # input shows NaN): the form draws a text field for the first type, with no suggestions (hetflow.spec.form).
    assert params["steps_per_epoch"].schema["type"] == ["string", "integer", "null"]
    assert params["epochs"].schema["type"] == ["string", "integer"]
    assert params["epochs"].schema["examples"] == [] and params["steps_per_epoch"].schema["examples"] == []
    assert params["learning_rate"].schema["exclusiveMinimum"] == 0
    # A number sent as a number is checked with the same bounds as the spec.
    params["epochs"].resolve(5)
    for outside in (0, -1, 1001):
        with pytest.raises(Exception, match="minimum|maximum"):
            params["epochs"].resolve(outside)
    # Typed text passes Airflow's schema as text; the spec reads it as the number it spells, or names it.
    assert params["epochs"].resolve("-1") == "-1" and parse_spec({"epochs": "7"}).training.epochs == 7
    with pytest.raises(SpecError, match='epochs="-1" is invalid: expected an integer >= 1 and <= 1000'):
        parse_spec({"epochs": params["epochs"].resolve("-1")})


def test_cli_validate_merges_config_and_set(hetflow_env, tmp_path):
    config = tmp_path / "spec.json"
    config.write_text(json.dumps({"model": "cnn", "epochs": 7}))
    done = hetflow(hetflow_env, "validate", "--config", str(config), "--set", "epochs=9")
    assert done.returncode == 0, done.stderr
    spec = json.loads(done.stdout)
    assert (spec["model"]["architecture"], spec["training"]["epochs"]) == ("cnn", 9)


def test_cli_output_cut_short_by_its_reader_ends_quietly_with_the_shells_sigpipe_status(hetflow_env):
    # The reader leaves before the command writes (`hetflow validate | head -0`).
    command = subprocess.Popen(
        [sys.executable, "-m", "hetflow.cli.main", "validate"],
        cwd=REPO,
        env=hetflow_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    command.stdout.close()
    stderr = command.stderr.read().decode()
    assert command.wait(timeout=120) == 141  # 128 + SIGPIPE, as `yes | head` leaves it
    assert stderr == ""


def test_cli_does_not_hide_a_broken_pipe_of_its_work_while_its_output_is_read(monkeypatch):
    from hetflow.cli import main as cli

    def validate_losing_a_peer(args):
        raise BrokenPipeError("a replica's socket")

    monkeypatch.setattr(cli, "_cmd_validate", validate_losing_a_peer)
    with pytest.raises(BrokenPipeError, match="a replica's socket"):
        cli.main(["validate"])


def test_cli_rejects_a_bad_spec_with_one_line_per_problem_and_starts_nothing(hetflow_env):
    runs = Path(hetflow_env["HETFLOW_HOME"]) / "runs"
    runs_before = set(runs.iterdir()) if runs.exists() else set()
    done = hetflow(hetflow_env, "run", "--set", "epochs=0", "--set", "strategy=gossip")
    assert done.returncode == 2
    assert sorted(done.stderr.strip().splitlines()) == [
        "hetflow: invalid spec: epochs=0 is invalid: expected an integer >= 1 and <= 1000",
        'hetflow: invalid spec: strategy="gossip" is invalid: expected one of auto, one_device, mirrored, '
        "multi_worker_mirrored, parameter_server, model_parallel",
    ]
    assert done.stdout == ""
    assert (set(runs.iterdir()) if runs.exists() else set()) == runs_before


def test_fields_of_other_backends_are_optional_in_the_form_and_empty_means_their_default():
    from hetflow.spec import BACKEND_ONLY_KEYS

    params = airflow_params()
    for key in BACKEND_ONLY_KEYS:
        # A type with null is what the form reads as "not required".
        assert "null" in params[key].schema["type"], key
        assert params[key].schema["section"].startswith("Cluster on "), key  # their own, closed section
        assert parse_spec({key: None}).flat()[key] == RunSpec().flat()[key], key
    assert params["workers"].schema["type"] == ["string", "integer"]
    assert params["workers"].schema["section"] == "Cluster"
    sections = {params[key].schema["section"] for key in ("kubernetes_namespace", "encrypt_network", "image")}
    assert sections == {"Cluster on kubernetes", "Cluster on swarm", "Cluster on docker, swarm, kubernetes"}
    assert parse_spec({"backend": "kubernetes", "kubernetes_namespace": None}).cluster.kubernetes.namespace == "default"
    with pytest.raises(SpecError, match="workers=null is invalid"):
        parse_spec({"workers": None})


def test_every_form_param_is_a_draft_07_schema_that_refuses_what_its_spec_key_refuses():
    """The forms declare draft-07 (hetflow.spec.form.SCHEMA_DRAFT, Airflow checks it thousands of
    times a run): each schema must be one draft-07 reads as written, bounds included."""
    from jsonschema import Draft7Validator
    from jsonschema.exceptions import ValidationError

    from hetflow.tuning.form import tune_params

    for key, param in {**airflow_params(), **tune_params()}.items():
        assert param.schema["$schema"] == "http://json-schema.org/draft-07/schema#", key
        Draft7Validator.check_schema(param.schema)
        assert param.resolve(suppress_exception=True) == param.value, key
    epochs = airflow_params()["epochs"]
    with pytest.raises(ValidationError):
        Draft7Validator(epochs.schema).validate(1001)
    assert epochs.resolve(7) == 7


@pytest.mark.parametrize(
    ("values", "registered"),
    [
        ({}, "hetflow-digits"),
        ({"dataset": "synthetic_cifar"}, "hetflow-synthetic-cifar"),
        ({"dataset": "mnist:3.0.1"}, "hetflow-mnist"),
        ({"dataset": "folder:/data/my_images"}, "hetflow-my-images"),
        ({"dataset": "folder:/data/my_images", "registered_model": "mine"}, "mine"),
        ({"dataset": "folder:/data/my_images", "registered_model": None}, "hetflow-my-images"),
    ],
)
def test_a_model_is_named_after_its_data_unless_the_spec_names_it(values, registered):
    """Two runs on two image folders with no registered_model both registered as hetflow-digits, and the
    second's gate compared its model with the first folder's champion."""
    spec = RunSpec.from_values(values)  # the folder's checks, which need it to exist, are parse_spec's
    assert spec.registry.model_name == registered
    assert RunSpec.from_json(spec.model_dump_json()).registry.model_name == registered  # spec.json reads back

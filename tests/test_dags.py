"""The DAG file: parses fast without TensorFlow, and wires the stages as the design says."""

from __future__ import annotations

import importlib
import inspect
import json
import re
import subprocess
import sys

import pytest
from conftest import REPO

_IMPORT_PROBE = """
import json, sys, time
import airflow.sdk  # already loaded in a dag-processor; not what this test times
started = time.perf_counter()
import importlib.util
spec = importlib.util.spec_from_file_location("hetflow_train", "dags/hetflow_train.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
elapsed = time.perf_counter() - started
heavy = sorted(m for m in ("tensorflow", "tf_keras", "mlflow", "tensorflow_datasets") if m in sys.modules)
print(json.dumps({"seconds": elapsed, "heavy": heavy}))
"""


def test_dag_file_imports_in_under_a_second_without_tensorflow(hetflow_env):
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE], cwd=REPO, env=hetflow_env, capture_output=True, text=True, check=True
    )
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["heavy"] == []
    assert probe["seconds"] < 1.0, probe


def test_dag_wiring(hetflow_env):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}
    dag = bag.dags["hetflow_train"]
    downstream = {t.task_id: sorted(t.downstream_task_ids) for t in dag.tasks}
    assert downstream == {
        "validate_spec": ["prepare_data"],
        "prepare_data": ["provision_cluster"],
        "provision_cluster": ["teardown_cluster", "train"],
        "train": ["evaluate", "teardown_cluster"],
        "teardown_cluster": ["summarize"],
        "evaluate": ["compress"],
        "compress": ["export"],
        "export": ["register"],
        "register": ["summarize"],
        "summarize": [],
    }
    assert dag.get_task("teardown_cluster").is_teardown
    assert dag.get_task("provision_cluster").is_setup
    assert dag.get_task("summarize").trigger_rule == "all_done"
    assert set(dag.params) >= {"dataset", "model", "epochs", "batch_size", "registered_model"}


def test_the_retrain_schedule_first_runs_at_the_crons_next_time_not_one_just_passed(hetflow_env, monkeypatch):
    from datetime import datetime, timedelta, timezone

    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.timetables.base import TimeRestriction

    passed = datetime.now(timezone.utc) - timedelta(minutes=2)
    monkeypatch.setenv("HETFLOW_RETRAIN_CRON", f"{passed.minute} {passed.hour} * * *")  # daily, 2 minutes ago
    dag = DagBag(dag_folder=str(REPO / "dags")).dags["hetflow_retrain"]
    # The timetable as the scheduler reads it: from the serialized DAG.
    timetable = DagSerialization.from_dict(DagSerialization.to_dict(dag)).timetable
    first = timetable.next_dagrun_info(
        last_automated_data_interval=None, restriction=TimeRestriction(earliest=None, latest=None, catchup=False)
    )
    assert first.run_after.date() == (passed + timedelta(days=1)).date()
    assert (first.run_after.hour, first.run_after.minute) == (passed.hour, passed.minute)


def test_tune_dag_wiring(hetflow_env):
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags")).dags["hetflow_tune"]
    downstream = {t.task_id: sorted(t.downstream_task_ids) for t in dag.tasks}
    assert downstream["validate_study"] == ["run_study"]
    # The best trial's run id reaches every later task; they run in the train DAG's order.
    assert downstream["run_study"] == ["compress", "evaluate", "export", "finish_study", "register"]
    assert [downstream[t] for t in ("evaluate", "compress", "export", "register")] == [
        ["compress"],
        ["export"],
        ["register"],
        ["finish_study"],
    ]
    assert dag.get_task("run_study").retries == 1
    assert set(dag.params) >= {"strategy", "workers", "learning_rate_range", "target_accuracy", "trials", "base"}


def test_deploy_dag_wiring_its_schedule_and_its_conf(hetflow_env):
    """The rollout's steps in order, scheduled on the Asset register's task emits an event on; a
    conf's model and version checked as a trigger checks them."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk.exceptions import ParamValidationError
    from airflow.serialization.serialized_objects import DagSerialization

    from hetflow.serving.control import CHAMPION_ASSET_URI

    bag = DagBag(dag_folder=str(REPO / "dags"))
    dag = bag.dags["hetflow_deploy"]
    assert [task.task_id for task in dag.topological_sort()] == [
        "stage",
        "start",
        "warm_and_check",
        "canary",
        "promote",
    ]
    assert all(len(task.downstream_task_ids) <= 1 for task in dag.tasks)
    assert [asset.uri for asset in dag.timetable.asset_condition.objects] == [CHAMPION_ASSET_URI]
    register = bag.dags["hetflow_train"].get_task("register")
    assert [alias.name for alias in register.outlets] == ["hetflow_champion_moves"]
    params = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag)).params
    for conf in ({"model": "hetflow-digits", "version": "3"}, {"model": "hetflow-digits", "version": 3}):
        params.deep_merge(conf).validate()
    with pytest.raises(ParamValidationError, match=r"^Invalid input for param version: 'v3' does not match '\^\[1-9\]"):
        params.deep_merge({"model": "hetflow-digits", "version": "v3"}).validate()


def test_a_triggered_runs_conf_takes_sections_as_objects_but_model_only_by_path(hetflow_env):
    """What docs/spec.md says of a conf: Airflow checks it against the form's fields before hetflow
    reads it, and `model` is both a section and the architecture's field."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk.exceptions import ParamValidationError
    from airflow.serialization.serialized_objects import DagSerialization

    dag = DagBag(dag_folder=str(REPO / "dags")).dags["hetflow_train"]
    params = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag)).params  # as a trigger checks them
    for conf in (
        {"training": {"epochs": 3}},
        {"cluster": {"worker": {"replicas": 3}, "ps": {"replicas": 1}}},
        {"model.architecture": "cnn"},
        {"model": "cnn"},
    ):
        params.deep_merge(conf).validate()
    with pytest.raises(ParamValidationError, match="param model: {'architecture': 'cnn'} is not of type 'string'"):
        params.deep_merge({"model": {"architecture": "cnn"}}).validate()


def test_every_task_runs_the_function_of_its_name_in_the_module_of_its_name(hetflow_env):
    """A reader finds each DAG task at ``hetflow/tasks/<task_id>``: the mapping is read from the DAG itself,
    so renaming a task without its module (or the reverse) fails here."""
    import importlib
    import inspect

    from airflow.dag_processing.dagbag import DagBag

    from hetflow.pipeline.attempts import STAGES

    bag = DagBag(dag_folder=str(REPO / "dags"))
    dag = bag.dags["hetflow_train"]
    for task in [*dag.tasks, *bag.dags["hetflow_tune"].tasks]:
        module = importlib.import_module(f"hetflow.tasks.{task.task_id}")
        function = getattr(module, task.task_id)
        assert callable(function) and function.__module__ == module.__name__, task.task_id
        body = inspect.getsource(task.python_callable)
        assert f"from hetflow.tasks import {task.task_id} as stage\n" in body, task.task_id
        assert f"stage.{task.task_id}(" in body, task.task_id
    # The stages whose records summarize checks are the DAG's tasks in order, less the two that write none.
    order = [task.task_id for task in dag.topological_sort()]
    assert list(STAGES) == [t for t in order if t not in ("teardown_cluster", "summarize")]


def signature_drift(architecture: str, stages: list[str]) -> list[str]:
    """Where a stage's signature differs from what ARCHITECTURE.md states: the run id first (values,
    then the run id, for the stages it names as taking the trigger's values first) and a dict returned
    (a list for those it names)."""
    text = " ".join(architecture.split())
    values_first = set(re.findall(r"`(\w+)`", text.split("takes the run id (", 1)[1].split(")", 1)[0]))
    returns_list = set(re.findall(r"`(\w+)`", text.split("returns its record as a dict (", 1)[1].split(")", 1)[0]))
    drift = []
    for stage in stages:
        signature = inspect.signature(getattr(importlib.import_module(f"hetflow.tasks.{stage}"), stage))
        leading = ["values", "run_id"] if stage in values_first else ["run_id"]
        if list(signature.parameters)[: len(leading)] != leading:
            drift.append(
                f"{stage} takes {', '.join(signature.parameters)}; ARCHITECTURE.md: {', '.join(leading)} first"
            )
        returned = "list" if stage in returns_list else "dict"
        if not str(signature.return_annotation).startswith(returned):
            drift.append(f"{stage} returns {signature.return_annotation}; ARCHITECTURE.md: a {returned}")
    return drift


def test_every_stage_takes_and_returns_what_architecture_md_states():
    architecture = (REPO / "ARCHITECTURE.md").read_text()
    stages = sorted(path.stem for path in (REPO / "hetflow" / "tasks").glob("*.py") if path.stem != "__init__")
    assert signature_drift(architecture, stages) == []
    planted = architecture.replace("`teardown_cluster`: the list", "the list").replace(", `validate_study`", "")
    assert signature_drift(planted, ["teardown_cluster", "validate_study"]) == [
        "teardown_cluster returns list; ARCHITECTURE.md: a dict",
        "validate_study takes values, run_id, dag_id, airflow_url; ARCHITECTURE.md: run_id first",
    ]


def test_every_task_keeps_library_stderr_off_error_and_return_values_out_of_its_log(hetflow_env):
    from airflow.dag_processing.dagbag import DagBag

    from hetflow.pipeline.task_log import CALLBACKS

    bag = DagBag(dag_folder=str(REPO / "dags"))
    for dag_id in ("hetflow_train", "hetflow_retrain", "hetflow_tune", "hetflow_deploy"):
        for task in bag.dags[dag_id].tasks:
            for name, callback in CALLBACKS.items():
                assert getattr(task, name) in (callback, [callback]), (dag_id, task.task_id, name)
    assert not any(task.show_return_value_in_logs for task in bag.dags["hetflow_train"].tasks)


# A task run as Airflow runs it: its stderr is a socket (the supervisor logs every line of it at
# ERROR), and the DAGs' callbacks run around its body; TensorFlow's C++ log (also while a stage
# module is imported) and progress bars write to file descriptor 2 directly.
_TASK_UNDER_AIRFLOW = r"""
import logging, os, socket, sys, types
# What TensorFlow 2.21 wrote while a stage imported it on a machine without a GPU (its lines cut at 120
# characters), and a warning of its own after.
TENSORFLOW_LOADING = b'''WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796167222.225577    8821 port.cc:153] oneDNN custom operations are on. You may see slightly
I0000 00:00:1796167222.225577    8821 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will
I0000 00:00:1796167222.336960    8821 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use available CPU
To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow with the
E0000 00:00:1796167226.061806    8821 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call
W0000 00:00:1796167315.234424     210 op_level_cost_estimator.cc:699] Error in PredictCost() for the op: op: "Softmax"
'''
logging.basicConfig(stream=sys.stdout, level=logging.DEBUG, format="%(levelname)s %(name)s %(message)s")
supervisor, child = socket.socketpair()
os.dup2(child.fileno(), 2)
from hetflow.pipeline.task_log import CALLBACKS

context = {"ti": types.SimpleNamespace(task_id="evaluate")}
CALLBACKS["on_execute_callback"](context)
os.write(2, TENSORFLOW_LOADING)
sys.stderr.write("\rGenerating splits: 1/3\rGenerating splits: 3/3\n")
if sys.argv[1] == "fail":
    context["exception"] = ValueError("no weights at model.weights.h5\nsecond line")
    CALLBACKS["on_failure_callback"](context)
else:
    CALLBACKS["on_success_callback"](context)
os.write(2, b"after the task\n")
supervisor.setblocking(False)
print("SOCKET", repr(supervisor.recv(4096)))
"""


def test_library_stderr_stays_off_the_task_logs_error_level(hetflow_env):
    def task(outcome: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", _TASK_UNDER_AIRFLOW, outcome],
            cwd=REPO,
            env=hetflow_env,
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout.splitlines()

    passed = task("pass")
    # Nothing the task wrote reached the socket; stderr is the socket again after it.
    assert passed[-1] == "SOCKET b'after the task\\n'", passed
    # TensorFlow's start-up notes and its probing for CUDA are logged at no level; its warning is kept.
    assert not [line for line in passed if re.search("cuInit|cuda drivers|absl|oneDNN|instructions", line)], passed
    assert any(line.startswith("DEBUG hetflow.library W0000 ") and "PredictCost" in line for line in passed), passed
    assert "DEBUG hetflow.library Generating splits: 3/3" in passed
    assert not [line for line in passed if line.startswith(("ERROR", "WARNING"))], passed

    failed = task("fail")
    assert failed[-1] == "SOCKET b'after the task\\n'", failed
    problems = [line for line in failed if line.startswith(("ERROR", "WARNING"))]
    # The libraries' last lines at WARNING, then one ERROR line naming the task and the cause.
    assert problems[-2:] == [
        "WARNING hetflow.library   Generating splits: 3/3",
        "ERROR hetflow.stages evaluate failed: ValueError: no weights at model.weights.h5",
    ], problems

"""The DAG file: parses fast without TensorFlow, and wires the stages as the design says."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_every_task_runs_the_function_of_its_name_in_the_module_of_its_name(hetflow_env):
    """A reader finds each DAG task at ``tasks/<task_id>``: the mapping is read from the DAG itself,
    so renaming a task without its module (or the reverse) fails here."""
    import importlib
    import inspect

    from airflow.dag_processing.dagbag import DagBag

    from tasks.attempts import STAGES

    dag = DagBag(dag_folder=str(REPO / "dags")).dags["hetflow_train"]
    for task in dag.tasks:
        module = importlib.import_module(f"tasks.{task.task_id}")
        function = getattr(module, task.task_id)
        assert callable(function) and function.__module__ == module.__name__, task.task_id
        body = inspect.getsource(task.python_callable)
        assert f"from tasks import {task.task_id} as stage\n" in body, task.task_id
        assert f"stage.{task.task_id}(" in body, task.task_id
    # The stages whose records summarize checks are the DAG's tasks in order, less the two that write none.
    order = [task.task_id for task in dag.topological_sort()]
    assert list(STAGES) == [t for t in order if t not in ("teardown_cluster", "summarize")]

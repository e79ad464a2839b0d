"""What bench/overhead.py measures apart from the run, just before it, and the first-use set-up it
does beforehand: one TensorFlow import (the aim's yardstick), the import of each stage's module in
DAG order, and the Airflow floor (a run of hetflow_train's shape with empty tasks)."""

from __future__ import annotations

import json
import subprocess
import time

from throughput_cases import BIN, REPO_ROOT

IMPORT_REPEATS = 3
# The DAG's tasks in the order of its wiring (dags/hetflow_train.py; teardown_cluster, after train, runs
# beside evaluate to register): one process imports their modules in about this order.
TASKS_IN_ORDER = (
    "validate_spec",
    "prepare_data",
    "provision_cluster",
    "train",
    "teardown_cluster",
    "evaluate",
    "compress",
    "export",
    "register",
    "summarize",
)
# Imports each task's module, given on the command line, in order; prints the seconds of each.
STAGE_IMPORTS = (
    "import importlib, json, sys, time\n"
    "seconds = {}\n"
    "for task in sys.argv[1:]:\n"
    "    started = time.perf_counter()\n"
    "    importlib.import_module(f'hetflow.tasks.{task}')\n"
    "    seconds[task] = time.perf_counter() - started\n"
    "print(json.dumps(seconds))\n"
)

# The Airflow floor: hetflow_train's shape with empty tasks (bench/airflow_floor/hetflow_floor.py) run
# as ``hetflow run`` runs hetflow_train, with hetflow's Airflow settings, in an Airflow home of its own
# (the last argument); its first use migrates that home's DB (set-up, not measured).
FLOOR_DAGS = REPO_ROOT / "bench" / "airflow_floor"
FLOOR_ENVIRONMENT = (
    "import os, sys; from hetflow.cli.dag_run import airflow_environment, ensure_airflow_db; "
    "os.environ.update({**airflow_environment(), 'AIRFLOW_HOME': sys.argv[-1], "
    f"'AIRFLOW__CORE__DAGS_FOLDER': {str(FLOOR_DAGS)!r}}}); ensure_airflow_db(); "
)
FLOOR_RUN = FLOOR_ENVIRONMENT + (
    "from airflow.dag_processing.dagbag import DagBag; "
    f"bag = DagBag(dag_folder={str(FLOOR_DAGS)!r}); assert not bag.import_errors, bag.import_errors; "
    "sys.exit(bag.get_dag('hetflow_floor').test(run_conf={}).state != 'success')"
)


# The first use of a home, each in a process of its own so that the measured run starts cold (argv: the
# validated spec, the floor's Airflow home).
SET_UP = {
    "dataset": (
        "import json, sys; from pathlib import Path; from hetflow.data.prepare import prepare_dataset; "
        "from hetflow.paths import data_dir; spec = json.loads(sys.argv[1])['data']; "
        "prepare_dataset(spec['dataset'], Path(spec['data_dir']) if spec['data_dir'] else data_dir(), "
        "spec['image_size'])"
    ),
    "airflow_db": (
        "import os; from hetflow.cli.dag_run import ensure_airflow_db, airflow_environment; "
        "os.environ.update(airflow_environment()); ensure_airflow_db()"
    ),
    "mlflow_store": (
        "from mlflow import MlflowClient; from hetflow.registry.store import tracking_uri; "
        "MlflowClient(tracking_uri()).search_experiments()"
    ),
    "airflow_floor_db": FLOOR_ENVIRONMENT,
}


class BenchFailed(RuntimeError):
    pass


def checked(done: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise BenchFailed(f"{what}: exit code {done.returncode}; last output:\n{tail}")
    return done


def set_up(run_args: list[str], env: dict[str, str]) -> dict[str, float]:
    """Seconds each first-use step took (not part of the run measured)."""
    validated = subprocess.run(
        [str(BIN / "hetflow"), "validate", *run_args], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    spec = json.loads(checked(validated, "hetflow validate").stdout)
    seconds = {}
    for step, code in SET_UP.items():
        started = time.monotonic()
        checked(python(code, env, json.dumps(spec), floor_home(env)), f"set-up step {step}")
        seconds[step] = time.monotonic() - started
    return seconds


def python(code: str, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    """``code`` run by this venv's Python in a fresh interpreter, with ``argv``, its output captured."""
    return subprocess.run(
        [str(BIN / "python"), "-c", code, *argv], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )


def floor_home(env: dict[str, str]) -> str:
    return f"{env['HETFLOW_HOME']}/airflow-floor"


def airflow_floor_seconds(env: dict[str, str]) -> float:
    """Launch to exit of one run of the Airflow floor (``FLOOR_RUN``)."""
    started = time.monotonic()
    done = python(FLOOR_RUN, env, floor_home(env))
    seconds = time.monotonic() - started
    checked(done, "the Airflow floor's run")
    return seconds


def tensorflow_import_seconds(env: dict[str, str]) -> list[float]:
    """Wall seconds of ``import tensorflow`` in a fresh interpreter, ``IMPORT_REPEATS`` times."""
    seconds = []
    for _ in range(IMPORT_REPEATS):
        started = time.monotonic()
        done = python("import tensorflow", env)
        seconds.append(time.monotonic() - started)
        checked(done, "import tensorflow")
    return seconds


def stage_import_seconds(env: dict[str, str]) -> dict[str, float]:
    """Seconds importing each task's module took in a fresh interpreter of this venv, in DAG order."""
    done = python(STAGE_IMPORTS, env, *TASKS_IN_ORDER)
    return json.loads(checked(done, "importing the stages' modules").stdout)

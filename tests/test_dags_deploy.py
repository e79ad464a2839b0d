"""The hetflow_deploy DAG through real Airflow (``dag.test`` in its own process, as ``hetflow run``
runs the train DAG) against a live endpoint in this process: real HAProxy, sandboxed model servers,
versions in a real MLflow store, under a steady load. One endpoint serves the module, in a model's
order: a good version promoted, then a bad one rolled back; then a run with no endpoint at all."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import pytest
from conftest import E2E_MODEL, NO_COMPRESSION, REPO, run_dag
from serving_load import SteadyLoad
from serving_models import load_images, register, save_version

from hetflow.registry import store
from hetflow.serving import control, policy
from hetflow.serving.endpoint import DEPLOYMENTS_EXPERIMENT, Endpoint
from hetflow.serving.server import free_port

pytestmark = pytest.mark.slow

MODEL = "deploy-digits"
LIMITS = policy.Limits(steps=(10, 50, 100), step_seconds=2.0, min_requests=20)  # short steps, as the endpoint's tests

_DEPLOY_RUN = """
import json, sys
from hetflow.cli.dag_run import ensure_airflow_db, ensure_dags_in_db
ensure_airflow_db()
from airflow.dag_processing.dagbag import DagBag
from hetflow.paths import REPO_ROOT
bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
ensure_dags_in_db(bag.dag_ids)
run = bag.get_dag("hetflow_deploy").test(run_conf=json.loads(sys.argv[1]))
from airflow.models.taskinstance import TaskInstance
from airflow.utils.session import create_session
from sqlalchemy import select
with create_session() as session:
    found = session.scalars(select(TaskInstance).where(TaskInstance.run_id == run.run_id))
    tasks = {ti.task_id: str(ti.state) for ti in found if ti.dag_id == "hetflow_deploy"}
print("DEPLOY-RUN", json.dumps({"state": str(run.state), "tasks": tasks}))
"""


def deploy_run(env: dict[str, str], conf: dict) -> tuple[dict, str]:
    """One hetflow_deploy run with ``conf``: its task states, and everything it printed."""
    done = subprocess.run(
        [sys.executable, "-c", _DEPLOY_RUN, json.dumps(conf)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    result = next((line for line in done.stdout.splitlines() if line.startswith("DEPLOY-RUN ")), None)
    assert result is not None, output[-4000:]
    return json.loads(result.removeprefix("DEPLOY-RUN ")), output


def _champion_events(airflow_run_id: str) -> list[tuple[str, dict]]:
    """The events on the champion Asset that a train DAG run's tasks emitted: (task, extra)."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(AssetEvent.source_task_id, AssetEvent.extra)
            .join(AssetModel, AssetModel.id == AssetEvent.asset_id)
            .where(AssetModel.uri == control.CHAMPION_ASSET_URI, AssetEvent.source_run_id == airflow_run_id)
        )
        return sorted(((task, dict(extra)) for task, extra in rows), key=json.dumps)


def test_register_emits_a_champion_event_for_each_model_whose_champion_it_moved(e2e_first_run):
    _, first = e2e_first_run  # the first versions of the float and TFLite models: both champions
    assert _champion_events(first["run_id"]) == [
        ("register", {"model": E2E_MODEL, "version": "1"}),
        ("register", {"model": f"{E2E_MODEL}-tflite", "version": "1"}),
    ]


@pytest.mark.heavy  # a second DAG run, for the event's absence (after the first, whose champion it cannot beat)
def test_register_emits_no_champion_event_where_champion_did_not_move(e2e_first_run, hetflow_env):
    _, kept = run_dag(hetflow_env, "epochs=1", "min_improvement=1", *NO_COMPRESSION)  # cannot pass the gate
    assert kept["status"] == "success" and kept["registry"]["promoted"] is False
    assert _champion_events(kept["run_id"]) == []


@pytest.fixture(scope="module")
def endpoint(hetflow_env, tmp_path_factory):
    """v1 served; v2 a good version, v3 one that fails a quarter of its requests (serving_models)."""
    root = tmp_path_factory.mktemp("deploy")
    client = store.client(hetflow_env["MLFLOW_TRACKING_URI"])
    for name, seed, fault in (("v1", 3, None), ("v2", 4, None), ("errors", 5, "errors")):
        save_version(root / name, seed, fault=fault, failing_share=0.25)
        register(client, MODEL, root / name)
    client.set_registered_model_alias(MODEL, "champion", "1")
    port = free_port()
    served = Endpoint(hetflow_env["MLFLOW_TRACKING_URI"], root / "e", port=port, models=(MODEL,), limits=LIMITS)
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=served.serve, args=(stop, ready))
    thread.start()
    try:
        assert ready.wait(120), "the first champion was not served in time"
        assert served.control is not None and served.control.path == control.socket_path()
        yield client, port
    finally:
        stop.set()
        thread.join(60)


def _champion(client) -> str:
    return str(client.get_registered_model(MODEL).aliases["champion"])


def test_a_deploy_run_promotes_a_good_version_each_task_logging_its_step(endpoint, hetflow_env):
    client, port = endpoint
    client.set_registered_model_alias(MODEL, "champion", "2")  # as register's gate does, before its event
    with SteadyLoad(port, MODEL, load_images(), rate_per_second=40) as load:
        run, output = deploy_run(hetflow_env, {"model": MODEL, "version": "2"})
    assert run["state"] == "success", output[-4000:]
    assert set(run["tasks"].values()) == {"success"}
    assert load.failed() == []
    for line in (
        rf"{MODEL} v2 stage: done in [\d.]+ s: files \d+, bytes \d+",
        rf"{MODEL} v2 start: done in [\d.]+ s: replicas 1",
        rf"{MODEL} v2 warm_and_check: done in [\d.]+ s: warm requests 20",
        rf"{MODEL} v2 canary at 10% for [\d.]+ s: \d+ requests, error rate 0\.00%, p99 [\d.]+ ms \(stable [\d.]+ ms\)",
        rf"{MODEL} v2 canary at 50% for [\d.]+ s: ",
        rf"{MODEL} v2 promote: done in [\d.]+ s: drain seconds [\d.]+",
    ):
        assert re.search(line, output), line
    assert _champion(client) == "2"
    assert client.get_model_version(MODEL, "2").tags["deployment"].startswith("promoted at ")
    # The DAG's request and the follower's poll joined one rollout: one run of it in the deployments experiment.
    experiment = client.get_experiment_by_name(DEPLOYMENTS_EXPERIMENT).experiment_id
    assert [run.info.run_name for run in client.search_runs([experiment])].count(f"{MODEL} v1 → v2") == 1


def test_a_bad_candidate_fails_the_run_at_canary_with_the_reason_and_champion_back(endpoint, hetflow_env):
    client, port = endpoint
    before = _champion(client)  # 2 after the test above, 1 when run alone
    client.set_registered_model_alias(MODEL, "champion", "3")
    with SteadyLoad(port, MODEL, load_images(), rate_per_second=40):
        run, output = deploy_run(hetflow_env, {"model": MODEL, "version": 3})
    assert run["state"] == "failed"
    assert run["tasks"] == {
        "stage": "success",
        "start": "success",
        "warm_and_check": "success",
        "canary": "failed",
        "promote": "upstream_failed",
    }
    reason = (
        rf"{MODEL} v3 rolled back at canary: canary at 10% rolled back: error rate \d+\.\d% "
        r"\(\d+ of \d+ requests\), over the limit 1\.0%"
    )
    # Besides Airflow's own "Task failed with exception" (its traceback kept for the log's reader), the
    # task's failure is one line: the step and the reason.
    errors = [line for line in _errors(output) if "Task failed with exception" not in line]
    assert len(errors) == 1 and re.search(r"\[error\s*\] canary failed: RolloutStopped: " + reason, errors[0]), errors
    assert _champion(client) == before
    assert client.get_model_version(MODEL, "3").tags["deployment.outcome"] == "rolled back"


@pytest.mark.heavy  # a third deploy run (45 s): no endpoint, nothing to follow
def test_with_no_endpoint_the_run_skips_saying_how_to_start_one(hetflow_env, tmp_path):
    elsewhere = {**hetflow_env, "HETFLOW_HOME": str(tmp_path)}  # the same Airflow DB, no socket under this home
    run, output = deploy_run(elsewhere, {"model": MODEL, "version": "2"})
    assert run == {
        "state": "success",
        "tasks": dict.fromkeys(("stage", "start", "warm_and_check", "canary", "promote"), "skipped"),
    }
    assert (
        f"no hetflow endpoint is running (nothing listens on {tmp_path}/serve/control.sock): "
        "start one with `make serve`" in output
    )
    assert _errors(output) == [], output[-3000:]


def _errors(output: str) -> list[str]:
    """The lines logged at ERROR, in Airflow's console format or the standard one."""
    return [line for line in output.splitlines() if re.search(r"\[error\s*\]|\bERROR\b", line)]

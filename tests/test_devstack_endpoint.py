"""``make up``'s endpoint (devstack/processes.py, devstack/stack.py): ``hetflow serve`` as a component
of the stack, on 127.0.0.1 at SERVE_PORT, its URL in what ``make up`` prints, its health in the
stack's; and, for real, the component started as ``make up`` starts it answering a TF Serving
request once a champion exists, then ended by ``make down``'s stop with everything it started."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys

import psutil
import pytest
from conftest import REPO, wait_for


@pytest.fixture
def home(hetflow_env, tmp_path, monkeypatch):
    """A HETFLOW_HOME and MLflow store of the test's own, as make up's (the endpoint reads the store)."""
    monkeypatch.setenv("HETFLOW_HOME", str(tmp_path))
    (tmp_path / "mlflow").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    return tmp_path


def test_the_endpoint_is_a_component_on_loopback_at_the_serve_port(home):
    from devstack import processes

    command = processes._commands(airflow_port=0, mlflow_port=0, serve_port=9123)["endpoint"]
    assert command == [sys.executable, "-m", "hetflow.cli.main", "serve", "--port", "9123"]  # no --host: 127.0.0.1
    assert processes._commands(airflow_port=0, mlflow_port=0)["endpoint"][-1] == "8501"  # TF Serving's REST port


def test_make_up_prints_the_endpoints_url_and_counts_it_in_the_stacks_health(home, capsys):
    from devstack import secrets, stack

    state = {
        "processes": {},
        "airflow_url": "http://127.0.0.1:1",
        "mlflow_url": "http://127.0.0.1:1",
        "endpoint_url": "http://127.0.0.1:8501",
        "database": "sqlite",
        "login": True,
        "password_file": str(secrets.password_file()),
        "seconds_to_healthy": 1.0,
    }
    stack._print_up(state, started=True)
    printed = capsys.readouterr().out.splitlines()
    at = printed.index(
        "  Endpoint http://127.0.0.1:8501/v1/models/<name>:predict   TF Serving's REST API (hetflow serve)"
    )
    assert printed[at + 1].strip() == (
        "serves each registered model's champion and follows the alias; make run registers one"
    )
    assert printed[-1] == "  stop with: make down"
    state["endpoint_url"] = "http://127.0.0.1:1"  # nothing listens there
    assert stack.health(state)["endpoint"] == "down"
    # A stack started by an earlier hetflow (no endpoint in its state) is judged without one.
    del state["endpoint_url"]
    assert "endpoint" not in stack.health(state)


def _predict(url: str, body: dict) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", "/v1/models/digits:predict", body=json.dumps(body))
        response = connection.getresponse()
        response.read()
        return response.status, response.getheader("X-Model-Version", "")
    except OSError:
        return 0, ""
    finally:
        connection.close()


@pytest.mark.slow
def test_make_ups_endpoint_serves_the_champion_and_make_down_ends_all_it_started(home, tmp_path):
    from serving_models import register, sample_images, save_version

    from devstack import processes, stack
    from hetflow.registry import store
    from hetflow.serving.server import free_port

    port, stack_id = free_port(), "endpoint-under-test"
    command = processes._commands(airflow_port=0, mlflow_port=0, serve_port=port)["endpoint"]
    log = (tmp_path / "endpoint.log").open("wb")
    component = subprocess.Popen(
        command,
        env={**os.environ, processes.STACK_ID_ENV: stack_id},
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # as processes.start starts it
    )
    started = {"pid": component.pid, "create_time": processes.create_time(component.pid)}
    state = {"airflow_url": "http://127.0.0.1:1", "mlflow_url": "http://127.0.0.1:1"}
    state["endpoint_url"] = f"http://127.0.0.1:{port}"
    try:
        # Healthy before any champion exists (a fresh stack has none), then serving the one registered.
        assert wait_for(lambda: stack.health(state)["endpoint"] == "healthy", 120), (
            tmp_path / "endpoint.log"
        ).read_text()
        client = store.client(store.tracking_uri())
        save_version(tmp_path / "v1", seed=3)
        client.set_registered_model_alias("digits", "champion", register(client, "digits", tmp_path / "v1"))
        request = {"instances": sample_images(2).tolist()}
        answered = wait_for(lambda: _predict(state["endpoint_url"], request) == (200, "1"), 180, interval=1)
        assert answered, (tmp_path / "endpoint.log").read_text()[-3000:]
        descendants = psutil.Process(component.pid).children(recursive=True)  # HAProxy, the model server
        assert len(descendants) >= 2, descendants
    finally:
        stopped = processes.stop({"endpoint": started}, stack_id)
        log.close()
    assert stopped == ["endpoint"]
    assert component.wait(5) == 0  # hetflow serve's own SIGTERM path: it ended what it started
    assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert "hetflow serve: stopped; its model servers and HAProxy have ended" in (tmp_path / "endpoint.log").read_text()

"""Two hosts of one MLflow registry for the registry tests: a real MLflow server over a SQL store,
started as make up starts it (the ``mlflow_server`` fixture), and the environment of a host of its
own (``_home``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow server over a SQL store, started as make up starts it; yields its port."""
    from devstack.processes import mlflow_server_command
    from hetflow.serving.server import free_port

    store = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    with (store / "server.log").open("w") as log:
        server = subprocess.Popen(
            mlflow_server_command(store / "mlflow.db", port),
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (store / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the MLflow server did not answer within 180 s"
                time.sleep(1)
        yield port
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def _home(tmp_path: Path, name: str, uri: str) -> dict[str, str]:
    """The environment of a host of its own: its HETFLOW_HOME, its spelling of the tracking URI."""
    (tmp_path / name).mkdir()
    return {**os.environ, "HETFLOW_HOME": str(tmp_path / name), "MLFLOW_TRACKING_URI": uri}

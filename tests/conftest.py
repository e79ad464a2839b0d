"""Shared fixtures: an isolated HETFLOW_HOME and MLflow store per test session."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def hetflow_env(tmp_path_factory) -> dict[str, str]:
    """Environment for hetflow commands: its own home, data dir, Airflow DB and MLflow store."""
    home = tmp_path_factory.mktemp("hetflow_home")
    (home / "mlflow").mkdir()
    env = {
        "HETFLOW_HOME": str(home),
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow' / 'mlflow.db'}",
    }
    os.environ.update(env)  # for what the test process itself uses (MlflowClient, tasks.paths, Airflow)
    from tasks.cli import airflow_environment

    os.environ.update(airflow_environment())
    return dict(os.environ)


def hetflow(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the ``hetflow`` command as a user would, capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "tasks.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_for(predicate, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def listening(address: str) -> bool:
    """A socket in LISTEN state on the port, on any interface (TF servers bind 0.0.0.0).

    Asked of the kernel, not by connecting: a connect to a free ephemeral port can connect to
    itself (TCP simultaneous open) and look like a listener."""
    port = int(address.rsplit(":", 1)[1])
    return any(c.laddr.port == port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN)

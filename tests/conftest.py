"""Shared fixtures: an isolated HETFLOW_HOME and MLflow store per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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

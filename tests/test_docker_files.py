"""The files of docker/: the Dockerfile passes hadolint, compose.yaml the compose schema, and the compose
stack holds postgres, Airflow and MLflow on a shared home."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from conftest import REPO

BIN = Path(sys.executable).parent


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=REPO)


def test_dockerfile_passes_hadolint_and_hadolint_rejects_a_bad_one(tmp_path):
    result = _run(BIN / "hadolint", "docker/Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nUSER root\n")
    result = _run(BIN / "hadolint", bad)
    assert result.returncode != 0 and "DL3007" in result.stdout  # "latest" is not a pinned base image


def test_compose_file_passes_the_compose_schema_and_the_schema_rejects_a_bad_one(tmp_path):
    result = _run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", "docker/compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  mlflow:\n    image: x\n    restart_policy: always\n")
    result = _run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", bad)
    assert result.returncode != 0 and "restart_policy" in result.stdout


def test_compose_stack_has_postgres_airflow_and_mlflow_on_a_shared_home():
    compose = yaml.safe_load((REPO / "docker/compose.yaml").read_text())
    services = compose["services"]
    assert {
        "postgres",
        "airflow-apiserver",
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
        "mlflow",
    } <= set(services)
    store = services["mlflow"]["environment"]["MLFLOW_BACKEND_STORE_URI"]  # its password kept off `ps`
    assert store.startswith("postgresql") and store.endswith("@postgres/mlflow")
    assert "--artifacts-destination=${HETFLOW_HOME}/mlflow-artifacts" in services["mlflow"]["command"]
    for name in ("airflow-scheduler", "mlflow"):
        assert "${HETFLOW_HOME}:${HETFLOW_HOME}" in services[name]["volumes"]
    assert "postgresql" in services["airflow-scheduler"]["environment"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    assert all(port.startswith("127.0.0.1:") for s in services.values() for port in s.get("ports", []))

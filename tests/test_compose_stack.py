"""The compose stack (docker/compose.yaml) started for real, as ``make up-docker`` starts it: the images
``make test-deps`` built (docker/stack-images.sh: PostgreSQL's offline where no registry answers), the
env file devstack/compose_env.py writes, ``docker compose up --wait``. Then a user's path through it:
log in to Airflow's API with the generated password, trigger one short hetflow_train run whose
replicas are containers of this host's engine (backend=docker, started by the scheduler container),
find the run in MLflow, and stop the stack as ``make down-docker`` does.

The stack gets a compose project, a HETFLOW_HOME and ports of its own, so a developer's
``make up-docker`` or ``make up`` beside it is left alone.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import requests
from conftest import REPO, wait_for

COMPOSE_FILE = REPO / "docker" / "compose.yaml"
# The smallest run that still trains on two docker replicas and goes through every stage.
CONF = {
    "backend": "docker",
    "strategy": "multi_worker_mirrored",
    "workers": 2,
    "epochs": 1,
    "steps_per_epoch": 4,
    "prune": False,
    "quantize": "none",
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _project_objects(client, project: str) -> dict[str, list[str]]:
    label = f"com.docker.compose.project={project}"
    return {
        "containers": [c.name for c in client.containers.list(all=True, filters={"label": label})],
        "networks": [n.name for n in client.networks.list(filters={"label": label})],
        "volumes": [v.name for v in client.volumes.list(filters={"label": label})],
    }


@pytest.fixture
def compose(docker_client, tmp_path):
    """``docker compose`` for a project of this test, with the env file make up-docker writes."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` (Compose v2): make test-deps installs it (docker/compose-cli.sh)")
    # The images make test-deps built, from Docker's cache (~20 s): rebuilt where the code changed since.
    subprocess.run([REPO / "docker" / "stack-images.sh"], check=True, capture_output=True)
    home = tmp_path / "home"
    project = f"hetflow-test-{os.getpid()}"
    ports = {"airflow": _free_port(), "mlflow": _free_port()}
    # Only the env file speaks to compose: a variable of this process's environment would outrank it.
    names = set(re.findall(r"\$\{(\w+)", COMPOSE_FILE.read_text()))
    env = {k: v for k, v in os.environ.items() if k not in names} | {
        "HETFLOW_HOME": str(home),
        "COMPOSE_PROJECT_NAME": project,
    }
    env_file = [sys.executable, "-m", "devstack.compose_env", "--airflow-port", str(ports["airflow"])]
    env_file += ["--mlflow-port", str(ports["mlflow"])]
    written = subprocess.run(env_file, cwd=REPO, env=env, capture_output=True, text=True)
    assert written.returncode == 0, written.stderr
    command = ["docker", "compose", "--env-file", str(home / "stack" / "compose.env"), "-f", str(COMPOSE_FILE)]

    def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([*command, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)

    stack = {"run": run, "env": env, "home": home, "project": project, "ports": ports, "env_file": env_file}
    try:
        yield stack
    finally:  # whatever happened: nothing of the project stays, its volume included
        run("down", "--remove-orphans", "--volumes", timeout=300)


@pytest.mark.slow
def test_the_compose_stack_comes_up_runs_a_docker_backend_dag_and_down_leaves_nothing(docker_client, compose):
    run, home, ports = compose["run"], compose["home"], compose["ports"]
    started = time.time()
    up = run("up", "--detach", "--wait")
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    healthy_after = round(time.time() - started)
    states = {
        c.name: c.attrs["State"]
        for c in docker_client.containers.list(
            all=True, filters={"label": f"com.docker.compose.project={compose['project']}"}
        )
    }
    health = {name.split("-", 3)[-1].rsplit("-", 1)[0]: s.get("Health", {}).get("Status") for name, s in states.items()}
    assert {health[name] for name in ("postgres", "airflow-apiserver", "airflow-scheduler", "mlflow")} == {"healthy"}, (
        health
    )
    # What make up-docker prints once healthy: where to go and where the password is, never the password.
    summary = subprocess.run(
        [*compose["env_file"], "--healthy-after", str(healthy_after)],
        cwd=REPO,
        env=compose["env"],
        capture_output=True,
        text=True,
    )
    password = json.loads((home / "stack" / "passwords.json").read_text())["admin"]
    assert (
        f"http://127.0.0.1:{ports['airflow']}: log in as admin, password in {home / 'stack' / 'passwords.json'}"
        in summary.stdout
    )
    assert f"http://127.0.0.1:{ports['mlflow']}" in summary.stdout and password not in summary.stdout

    airflow, mlflow = f"http://127.0.0.1:{ports['airflow']}", f"http://127.0.0.1:{ports['mlflow']}"
    refused = requests.post(f"{airflow}/auth/token", json={"username": "admin", "password": password + "x"}, timeout=30)
    assert refused.status_code == 401  # login is on
    token = requests.post(f"{airflow}/auth/token", json={"username": "admin", "password": password}, timeout=30)
    token.raise_for_status()
    api = requests.Session()
    api.headers["Authorization"] = f"Bearer {token.json()['access_token']}"
    assert wait_for(lambda: api.get(f"{airflow}/api/v2/dags/hetflow_train", timeout=30).ok, timeout=120, interval=2)
    triggered = api.post(
        f"{airflow}/api/v2/dags/hetflow_train/dagRuns", json={"logical_date": None, "conf": CONF}, timeout=30
    )
    assert triggered.status_code == 200, triggered.text
    run_id = triggered.json()["dag_run_id"]
    dag_run = f"{airflow}/api/v2/dags/hetflow_train/dagRuns/{run_id}"
    finished = wait_for(
        lambda: (r := api.get(dag_run, timeout=30).json())["state"] in ("success", "failed") and r, 600, 5
    )
    tasks = api.get(f"{dag_run}/taskInstances", timeout=30).json()["task_instances"]

    def failure(task: str) -> list[str]:  # a failed task's log names its failure in one line
        log = api.get(f"{dag_run}/taskInstances/{task}/logs/1", params={"full_content": True}, timeout=30)
        return sorted({str(line.get("event")) for line in log.json()["content"] if f"{task} failed" in str(line)})

    failed = {ti["task_id"]: failure(ti["task_id"]) for ti in tasks if ti["state"] == "failed"}
    assert finished and finished["state"] == "success", failed

    # The replicas were two containers of the replica image, started by the scheduler, and are gone.
    [summary_file] = (home / "runs").glob("*/summary.json")
    run_summary = json.loads(summary_file.read_text())
    labelled = {"label": f"hetflow.run-id={run_id}", "type": "container", "event": "start"}
    starts = docker_client.events(since=int(started), until=int(time.time()) + 1, filters=labelled, decode=True)
    assert (
        sorted((e["Actor"]["Attributes"]["hetflow.role"], e["from"]) for e in starts)
        == [("worker", "hetflow-replica:0.1.0")] * 2
    )
    assert "Epoch 1/1" in (summary_file.parent / "logs" / "worker-0.log").read_text()
    assert docker_client.containers.list(all=True, filters={"label": f"hetflow.run-id={run_id}"}) == []

    # MLflow (PostgreSQL store) has the run, under this Airflow run, with the run's test accuracy.
    found = requests.get(
        f"{mlflow}/api/2.0/mlflow/runs/get", params={"run_id": run_summary["mlflow_run_id"]}, timeout=30
    )
    found.raise_for_status()
    mlflow_run = found.json()["run"]
    assert mlflow_run["info"]["status"] == "FINISHED"
    assert {t["key"]: t["value"] for t in mlflow_run["data"]["tags"]}["airflow.run_id"] == run_id
    metrics = {m["key"]: m["value"] for m in mlflow_run["data"]["metrics"]}
    assert metrics["test_accuracy"] == pytest.approx(run_summary["metrics"]["test_accuracy"])

    # make down-docker: containers and network go, the databases' volume stays for the next start.
    down = run("down", "--remove-orphans", timeout=300)
    assert down.returncode == 0, down.stderr
    left = _project_objects(docker_client, compose["project"])
    assert left == {"containers": [], "networks": [], "volumes": [f"{compose['project']}_postgres-data"]}, left

"""The compose stack (docker/compose.yaml) started for real, as ``make up-docker`` starts it: the images
``make test-deps`` built (docker/stack-images.sh: PostgreSQL's offline where no registry answers), the
env file devstack/compose_env.py writes, ``docker compose up --wait``. Then a user's path through it:
log in to Airflow's API with the generated password, trigger one short hetflow_train run whose
replicas are containers of this host's engine (backend=docker, started by the scheduler container),
find the run in MLflow, ask the endpoint service (hetflow serve) for a prediction from the champion
that run registered, and stop the stack as ``make down-docker`` does. What a user sees of it is
checked in headless Chromium on the way (tests/ui_pages.py, as test_e2e_ui_airflow.py checks
``make up``'s): the trigger form refusing a typed -1 in Epochs, the DAG's docs, and the MLflow links
it prints.

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
import threading
import time

import pytest
import requests
from conftest import REPO, wait_for
from ui_pages import (
    assert_key_metrics_first,
    chromium,
    dag_docs,
    open_runs_page,
    open_trigger_form,
    refuse_epochs_typed_out_of_range,
    signed_in,
)

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
    ports = {"airflow": _free_port(), "mlflow": _free_port(), "endpoint": _free_port()}
    # Only the env file speaks to compose: a variable of this process's environment would outrank it.
    names = set(re.findall(r"\$\{(\w+)", COMPOSE_FILE.read_text()))
    env = {k: v for k, v in os.environ.items() if k not in names} | {
        "HETFLOW_HOME": str(home),
        "COMPOSE_PROJECT_NAME": project,
    }
    env_file = [sys.executable, "-m", "devstack.compose_env", "--airflow-port", str(ports["airflow"])]
    env_file += ["--mlflow-port", str(ports["mlflow"]), "--serve-port", str(ports["endpoint"])]
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


@pytest.fixture
def browser(compose):  # of the test's compose project, as its stack is
    from ui_stack import MlflowLogin

    for opened in chromium():
        yield MlflowLogin(opened, f"http://127.0.0.1:{compose['ports']['mlflow']}", compose["home"])


def _collect(events, into: list) -> None:
    try:
        into.extend(events)
    except Exception:  # noqa: BLE001  (the stream closed under it: what came is in)
        pass


@pytest.mark.slow
@pytest.mark.heavy
def test_the_compose_stack_comes_up_runs_a_docker_backend_dag_and_down_leaves_nothing(docker_client, compose, browser):
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
    healthy = ("postgres", "airflow-apiserver", "airflow-scheduler", "mlflow", "endpoint")
    assert {health[name] for name in healthy} == {"healthy"}, health
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
    runs_link = re.search(r"hetflow's runs: (\S+)", summary.stdout)
    charts_link = re.search(r"their key metrics: (\S+)", summary.stdout)
    assert runs_link and charts_link, summary.stdout

    airflow, mlflow = f"http://127.0.0.1:{ports['airflow']}", f"http://127.0.0.1:{ports['mlflow']}"
    refused = requests.post(f"{airflow}/auth/token", json={"username": "admin", "password": password + "x"}, timeout=30)
    assert refused.status_code == 401  # login is on
    token = requests.post(f"{airflow}/auth/token", json={"username": "admin", "password": password}, timeout=30)
    token.raise_for_status()
    api = requests.Session()
    api.headers["Authorization"] = f"Bearer {token.json()['access_token']}"
    assert wait_for(lambda: api.get(f"{airflow}/api/v2/dags/hetflow_train", timeout=30).ok, timeout=120, interval=2)

    # In Chromium, signed in through the login page: the form keeps a typed -1 in Epochs as typed and
    # refuses it, the reason above the Trigger button, and no run starts; the DAG's docs are for users.
    page = signed_in(browser, airflow, password, "/dags/hetflow_train")
    refuse_epochs_typed_out_of_range(page, *open_trigger_form(page))
    assert api.get(f"{airflow}/api/v2/dags/hetflow_train/dagRuns", timeout=30).json()["total_entries"] == 0
    page.goto(f"{airflow}/dags/hetflow_train")
    docs = dag_docs(page)
    docs.get_by_text("Where the results go").wait_for()
    shown = docs.inner_text()
    for says in ("Press Trigger to start a run", "a refused value is named", "MLflow, experiment hetflow"):
        assert says in shown, shown
    assert "wiring" not in shown.lower() and "**" not in shown and "`" not in shown, shown  # rendered, not code
    triggered = api.post(
        f"{airflow}/api/v2/dags/hetflow_train/dagRuns", json={"logical_date": None, "conf": CONF}, timeout=30
    )
    assert triggered.status_code == 200, triggered.text
    run_id = triggered.json()["dag_run_id"]
    # Followed live from the trigger on: the engine keeps only its last 256 events, and the stack's
    # health checks alone make more than that while a run trains.
    labelled = {"label": f"hetflow.run-id={run_id}", "type": "container", "event": "start"}
    events, starts = docker_client.events(filters=labelled, decode=True), []
    threading.Thread(target=_collect, args=(events, starts), daemon=True).start()
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
    events.close()
    assert (
        sorted((e["Actor"]["Attributes"]["hetflow.role"], e["from"]) for e in starts)
        == [("worker", "hetflow-replica:0.1.0")] * 2
    )
    assert "Epoch 1/1" in (summary_file.parent / "logs" / "worker-0.log").read_text()
    assert docker_client.containers.list(all=True, filters={"label": f"hetflow.run-id={run_id}"}) == []

    # MLflow (PostgreSQL store) has the run, under this Airflow run, with the run's test accuracy.
    get_run = f"{mlflow}/api/2.0/mlflow/runs/get"
    assert requests.get(get_run, params={"run_id": run_summary["mlflow_run_id"]}, timeout=30).status_code == 401
    admin = ("admin", json.loads((compose["home"] / "stack" / "mlflow.json").read_text())["admin_password"])
    found = requests.get(get_run, params={"run_id": run_summary["mlflow_run_id"]}, auth=admin, timeout=30)
    found.raise_for_status()
    mlflow_run = found.json()["run"]
    assert mlflow_run["info"]["status"] == "FINISHED"
    assert {t["key"]: t["value"] for t in mlflow_run["data"]["tags"]}["airflow.run_id"] == run_id
    metrics = {m["key"]: m["value"] for m in mlflow_run["data"]["metrics"]}
    assert metrics["test_accuracy"] == pytest.approx(run_summary["metrics"]["test_accuracy"], abs=5e-5)
    # The links make up-docker printed: hetflow's experiment on its runs, listing this run by what it
    # was, and the chart view with the key metrics first.
    run_name = mlflow_run["info"]["run_name"]
    assert re.fullmatch(
        r"sync 2w epochs=1 steps_per_epoch=4 prune=False quantize=none backend=docker \d\d:\d\d:\d\d", run_name
    ), run_name
    assert f"/#/experiments/{mlflow_run['info']['experiment_id']}/runs?" in runs_link[1], runs_link[1]
    open_runs_page(page, runs_link[1], run_name)
    assert_key_metrics_first(page, charts_link[1], set(metrics))
    page.close()

    # The endpoint service follows the champion the run registered: a TF Serving request, with the
    # token make up-docker generated (refused without it), on the loopback-published port.
    predict = f"http://127.0.0.1:{ports['endpoint']}/v1/models/hetflow-digits:predict"
    serve_token = json.loads((home / "stack" / "serve.json").read_text())["token"]
    image = {"instances": [[[[0]] * 8] * 8]}  # one 8x8 black image, as raw pixels
    assert f"http://127.0.0.1:{ports['endpoint']}/v1/models/<name>:predict" in summary.stdout
    assert requests.post(predict, json=image, timeout=30).status_code == 401
    bearer = {"Authorization": f"Bearer {serve_token}"}
    answered = wait_for(lambda: (r := requests.post(predict, json=image, headers=bearer, timeout=30)).ok and r, 240, 2)
    assert answered and answered.headers["X-Model-Version"] == "1", answered and answered.text
    assert len(answered.json()["predictions"][0]) == 10  # a digit's logits

    # make down-docker: containers and network go, the databases' volume stays for the next start.
    down = run("down", "--remove-orphans", timeout=300)
    assert down.returncode == 0, down.stderr
    left = _project_objects(docker_client, compose["project"])
    assert left == {"containers": [], "networks": [], "volumes": [f"{compose['project']}_postgres-data"]}, left

"""The stack of ``make up`` and a run started from its trigger form, for the UI tests
(test_e2e_ui_airflow.py, test_e2e_ui_mlflow.py); loaded by conftest as a plugin.

One stack for the session (``python -m devstack.stack up``, what ``make up`` runs) on free ports over
a temporary HETFLOW_HOME; ``down`` after it, and then no process of it may be left. The screenshots
docs/ shows go to docs/screenshots/ (``SCREENSHOTS``), the others to tests/artifacts/.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import requests
from conftest import REPO, TUNE_STUDY, wait_for
from ui_pages import (
    assert_on_screen_above,
    chromium,
    field,
    open_trigger_form,
    refuse_epochs_typed_out_of_range,
    signed_in,
    text_field,
    type_into,
)

ARTIFACTS = REPO / "tests" / "artifacts"
# The screenshots docs/ shows, written where it links them.
SCREENSHOTS = REPO / "docs" / "screenshots"
RUN_TIMEOUT = 420  # seconds for one tiny hetflow_train run on 2 cores


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stack_processes(home: Path) -> list[psutil.Process]:
    """Every process whose environment points at this stack's HETFLOW_HOME."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("HETFLOW_HOME") == str(home):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


class Api:
    """Airflow's REST API with a JWT from /auth/token, as any client would use it."""

    def __init__(self, url: str, username: str, password: str):
        self.url = url
        token = requests.post(f"{url}/auth/token", json={"username": username, "password": password}, timeout=30)
        token.raise_for_status()
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token.json()['access_token']}"

    def get(self, path: str, **params) -> dict:
        response = self.session.get(f"{self.url}/api/v2{path}", params=params, timeout=30)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: dict) -> requests.Response:
        return self.session.post(f"{self.url}/api/v2{path}", json=body, timeout=30)

    def patch(self, path: str, body: dict) -> requests.Response:
        return self.session.patch(f"{self.url}/api/v2{path}", json=body, timeout=30)

    def runs(self, dag_id: str) -> list[dict]:
        return self.get(f"/dags/{dag_id}/dagRuns", order_by="-run_after")["dag_runs"]

    def task_logs(self, dag_id: str, run_id: str) -> dict[str, list[dict]]:
        """Every task's log entries (try 1) of a DAG run, as the UI's log view reads them."""
        tasks = self.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
        return {
            ti["task_id"]: self.get(
                f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{ti['task_id']}/logs/1", full_content=True
            )["content"]
            for ti in tasks
            if ti["try_number"]
        }

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = RUN_TIMEOUT) -> dict:
        finished = wait_for(
            lambda: (run := self.get(f"/dags/{dag_id}/dagRuns/{run_id}"))["state"] in ("success", "failed") and run,
            timeout,
            interval=3,
        )
        assert finished, f"{dag_id} run {run_id} did not finish in {timeout} s"
        return finished


def error_lines(entries: list[dict]) -> list[str]:
    """The ERROR and CRITICAL lines of a task's log entries (``Api.task_logs``)."""
    return [str(entry.get("event")) for entry in entries if entry.get("level") in ("error", "critical")]


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("ui_home")
    (home / "mlflow").mkdir()
    env = {
        **os.environ,
        "HETFLOW_HOME": str(home),
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow' / 'mlflow.db'}",
    }
    ports = ["--airflow-port", str(_free_port()), "--mlflow-port", str(_free_port()), "--serve-port", str(_free_port())]
    command = [sys.executable, "-m", "devstack.stack"]
    try:
        up = subprocess.run([*command, "up", *ports], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        state = json.loads((home / "stack" / "state.json").read_text())
        again = subprocess.run([*command, "up", *ports], cwd=REPO, env=env, capture_output=True, text=True)
        assert again.returncode == 0 and "already running" in again.stdout, again.stdout + again.stderr
        yield {"home": home, "env": env, "state": state, "up_output": up.stdout}
    finally:
        down = subprocess.run([*command, "down"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        assert wait_for(lambda: not _stack_processes(home), timeout=10), _stack_processes(home)
        assert not (home / "stack" / "state.json").exists()


@pytest.fixture(scope="session")
def api(stack) -> Api:
    from devstack.stack import password

    client = Api(stack["state"]["airflow_url"], "admin", password(stack["state"]))
    # The dag-processor parses dags/ within ~10 s of starting.
    parsed = wait_for(
        lambda: {d["dag_id"] for d in client.get("/dags")["dags"]} >= {"hetflow_train", "hetflow_retrain"}, 90
    )
    assert parsed, client.get("/dags")
    return client


class MlflowLogin:
    """Chromium whose pages answer the MLflow server's login (HTTP basic auth) with its admin's, sent
    to that server only; everything else is the browser's."""

    def __init__(self, browser, mlflow_url: str, home: Path):
        self.browser = browser
        password = json.loads((home / "stack" / "mlflow.json").read_text())["admin_password"]
        self.credentials = {"username": "admin", "password": password, "origin": mlflow_url}

    def new_page(self, **options):
        return self.browser.new_page(http_credentials=self.credentials, **options)

    def __getattr__(self, name: str):
        return getattr(self.browser, name)


@pytest.fixture(scope="session")
def browser(stack):
    for opened in chromium():
        yield MlflowLogin(opened, stack["state"]["mlflow_url"], stack["home"])


@pytest.fixture(scope="session")
def form_run(stack, api, browser):
    """Log in, open hetflow_train's trigger form, type an epoch count out of range, a dataset TFDS does
    not know, then a bad cluster shape, read each refusal, fix them, submit, and wait for the run
    through the REST API."""
    from devstack.stack import password

    state = stack["state"]
    ARTIFACTS.mkdir(exist_ok=True)
    page = signed_in(browser, state["airflow_url"], password(state), "/dags/hetflow_train")
    dialog, trigger = open_trigger_form(page)
    before = {run["dag_run_id"] for run in api.runs("hetflow_train")}
    epochs = refuse_epochs_typed_out_of_range(page, dialog, trigger)
    page.screenshot(path=str(SCREENSHOTS / "trigger_form_refused.png"))
    assert {run["dag_run_id"] for run in api.runs("hetflow_train")} == before
    type_into(epochs, "2")
    # A dataset name typed as a person types it, one key at a time: refused at Trigger, no run.
    dialog.get_by_text("Data", exact=True).click()
    dataset = text_field(dialog, "dataset")
    type_into(dataset, "mnistt")
    trigger.click()
    refusal = dialog.get_by_text("invalid spec: dataset='mnistt' is not a TFDS dataset (did you mean mnist?)")
    refusal.wait_for()
    assert_on_screen_above(page, refusal, trigger)
    assert {run["dag_run_id"] for run in api.runs("hetflow_train")} == before
    dataset.fill("uci_digits")

    def opened(section: str, title: str) -> str:
        """Open ``section`` (closing the one open) and read the label of its field ``title``."""
        dialog.get_by_text(section, exact=True).click()
        return dialog.locator("label", has_text=re.compile(f"^{re.escape(title)}")).first.inner_text()

    # Fields only some backends read are in sections of their own, closed, and optional (no required
    # mark); descriptions render as Markdown. Cluster itself holds what every backend reads.
    label = {
        "Kubernetes namespace": opened("Cluster on kubernetes", "Kubernetes namespace"),
        "CPUs per replica": opened("Cluster on docker, swarm, kubernetes", "CPUs per replica"),
        "Workers": opened("Cluster", "Workers"),
    }
    assert label["Workers"].endswith("*"), label
    assert not label["Kubernetes namespace"].endswith("*") and not label["CPUs per replica"].endswith("*"), label
    assert not dialog.get_by_text("Kubernetes namespace").first.is_visible()
    assert "`" not in dialog.inner_text()
    type_into(text_field(dialog, "workers"), "2")
    type_into(text_field(dialog, "ps"), "1")
    # strategy is still one_device: the REST API answers 400 and the form shows its lines.
    trigger.click()
    message = dialog.get_by_text("invalid spec: workers=2 is invalid with strategy=one_device")
    message.wait_for()
    assert dialog.get_by_text("invalid spec: ps=1 is invalid with strategy=one_device").count() == 1
    assert_on_screen_above(page, dialog.get_by_text("invalid spec: ps=1 is invalid"), trigger)
    page.screenshot(path=str(SCREENSHOTS / "trigger_form_error.png"))
    assert {run["dag_run_id"] for run in api.runs("hetflow_train")} == before
    dialog.get_by_label(field("Distribution strategy")).click()
    page.get_by_role("option", name="parameter_server", exact=True).click()
    page.screenshot(path=str(ARTIFACTS / "trigger_form.png"))
    trigger.click()
    # The toast may be rendered twice; it waits for the UI's queries to refresh, slow on a busy machine.
    page.get_by_text("Dag Run Triggered").first.wait_for(timeout=120_000)
    new = wait_for(lambda: [r for r in api.runs("hetflow_train") if r["dag_run_id"] not in before], 30)
    assert len(new) == 1, new
    run = api.wait_for_run("hetflow_train", new[0]["dag_run_id"])
    page.goto(f"{state['airflow_url']}/dags/hetflow_train/runs/{run['dag_run_id']}")
    page.get_by_text("success").first.wait_for()
    page.screenshot(path=str(SCREENSHOTS / "finished_run.png"))
    yield page, run
    page.close()


@pytest.fixture(scope="session")
def mlflow_client(stack):
    from mlflow import MlflowClient

    # Through the MLflow server, as the UI reads it, logged in as its admin (anonymous gets 401).
    password = json.loads((stack["home"] / "stack" / "mlflow.json").read_text())["admin_password"]
    os.environ.update(MLFLOW_TRACKING_USERNAME="admin", MLFLOW_TRACKING_PASSWORD=password)
    return MlflowClient(stack["state"]["mlflow_url"])


@pytest.fixture(scope="session")
def form_mlflow_run(mlflow_client, form_run):
    """The MLflow run of the form's DAG run."""
    _, run = form_run
    [mlflow_run] = mlflow_client.search_runs(
        [mlflow_client.get_experiment_by_name("hetflow").experiment_id],
        filter_string=f"tags.`airflow.run_id` = '{run['dag_run_id']}'",
    )
    return mlflow_run


@pytest.fixture(scope="session")
def study_run(api) -> dict:
    """A hetflow_tune run of TUNE_STUDY (two trials side by side), triggered through the REST API,
    finished."""
    response = api.post("/dags/hetflow_tune/dagRuns", {"logical_date": None, "conf": TUNE_STUDY})
    assert response.status_code == 200, response.text
    return api.wait_for_run("hetflow_tune", response.json()["dag_run_id"])

"""Airflow and MLflow as users use them: the stack of ``make up``, the trigger form in headless
Chromium, the REST API's answer to a bad conf, and retraining started by the data Asset.

One stack for the module (``python -m devstack.stack up``, what ``make up`` runs) on free ports over
a temporary HETFLOW_HOME; ``down`` after it, and then no process of it may be left. Screenshots go
to tests/artifacts/ (the README's come from there).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import psutil
import pytest
import requests
from conftest import REPO, wait_for
from ui_pages import (
    assert_key_metrics_first,
    assert_on_screen_above,
    chromium,
    dag_docs,
    field,
    open_runs_page,
    open_trigger_form,
    refuse_epochs_typed_out_of_range,
    signed_in,
)

pytestmark = pytest.mark.slow

ARTIFACTS = REPO / "tests" / "artifacts"
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

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = RUN_TIMEOUT) -> dict:
        finished = wait_for(
            lambda: (run := self.get(f"/dags/{dag_id}/dagRuns/{run_id}"))["state"] in ("success", "failed") and run,
            timeout,
            interval=3,
        )
        assert finished, f"{dag_id} run {run_id} did not finish in {timeout} s"
        return finished


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("ui_home")
    (home / "mlflow").mkdir()
    env = {
        **os.environ,
        "HETFLOW_HOME": str(home),
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow' / 'mlflow.db'}",
    }
    ports = ["--airflow-port", str(_free_port()), "--mlflow-port", str(_free_port())]
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


@pytest.fixture(scope="module")
def api(stack) -> Api:
    from devstack.stack import password

    client = Api(stack["state"]["airflow_url"], "admin", password(stack["state"]))
    # The dag-processor parses dags/ within ~10 s of starting.
    parsed = wait_for(
        lambda: {d["dag_id"] for d in client.get("/dags")["dags"]} >= {"hetflow_train", "hetflow_retrain"}, 90
    )
    assert parsed, client.get("/dags")
    return client


def test_make_up_is_healthy_prints_the_urls_and_how_to_log_in(stack):
    from devstack.stack import health, rss_bytes

    state = stack["state"]
    assert all(status == "healthy" for status in health(state).values()), health(state)
    output = stack["up_output"]
    assert state["airflow_url"] in output and state["mlflow_url"] in output
    assert "log in as admin, password" in output
    runs = rf"{state['mlflow_url']}/#/experiments/\d+/runs\?workflowType=machine_learning"
    assert re.search(f"hetflow's runs: {runs}", output), output
    charts = f"{runs}&compareRunsMode=CHART&viewStateShareKey=hetflow-key-metrics\n"
    assert re.search(f"their key metrics: {charts}", output), output
    ARTIFACTS.mkdir(exist_ok=True)
    measured = {"seconds_to_healthy": state["seconds_to_healthy"], "rss_gib": round(rss_bytes(state) / 2**30, 2)}
    (ARTIFACTS / "stack.json").write_text(json.dumps(measured, indent=2))
    print(f"\nmake up: {measured}")
    # The login is on: the API refuses a request without a token.
    assert requests.get(f"{state['airflow_url']}/api/v2/dags", timeout=30).status_code == 401


def test_rest_trigger_with_a_bad_conf_gets_400_naming_the_field_and_starts_nothing(api):
    before = api.runs("hetflow_train")
    cases = {
        "workers=99 is invalid: expected an integer >= 1 and <= 16": {"workers": 99},
        'strategy="gossip" is invalid: expected one of auto, one_device': {"strategy": "gossip"},
        "unknown key 'epoch'=3 (did you mean 'epochs'?)": {"epoch": 3},
        "workers=2 is invalid with strategy=one_device": {"strategy": "one_device", "workers": 2},
    }
    for message, conf in cases.items():
        response = api.post("/dags/hetflow_train/dagRuns", {"logical_date": None, "conf": conf})
        assert response.status_code == 400, (conf, response.text)
        assert message in response.json()["detail"], (conf, response.json())
    assert api.runs("hetflow_train") == before


@pytest.fixture(scope="module")
def browser():
    yield from chromium()


@pytest.fixture(scope="module")
def form_run(stack, api, browser):
    """Log in, open hetflow_train's trigger form, type an epoch count out of range, then a bad
    cluster shape, read each refusal, fix them, submit, and wait for the run through the REST API."""
    from devstack.stack import password

    state = stack["state"]
    ARTIFACTS.mkdir(exist_ok=True)
    page = signed_in(browser, state["airflow_url"], password(state), "/dags/hetflow_train")
    dialog, trigger = open_trigger_form(page)
    before = {run["dag_run_id"] for run in api.runs("hetflow_train")}
    epochs = refuse_epochs_typed_out_of_range(page, dialog, trigger)
    page.screenshot(path=str(ARTIFACTS / "trigger_form_refused.png"))
    assert {run["dag_run_id"] for run in api.runs("hetflow_train")} == before
    epochs.fill("2")
    dialog.get_by_text("Cluster", exact=True).click()
    # Fields of other backends are optional (no required mark), and descriptions render as Markdown.
    label = {
        title: dialog.locator("label", has_text=re.compile(f"^{re.escape(title)}")).first.inner_text()
        for title in ("Workers", "Kubernetes namespace", "CPUs per replica")
    }
    assert label["Workers"].endswith("*"), label
    assert not label["Kubernetes namespace"].endswith("*") and not label["CPUs per replica"].endswith("*"), label
    assert "`" not in dialog.inner_text()
    dialog.get_by_label(field("Workers")).fill("2")
    dialog.get_by_label(field("Parameter servers")).fill("1")
    # strategy is still one_device: the REST API answers 400 and the form shows its lines.
    trigger.click()
    message = dialog.get_by_text("invalid spec: workers=2 is invalid with strategy=one_device")
    message.wait_for()
    assert dialog.get_by_text("invalid spec: ps=1 is invalid with strategy=one_device").count() == 1
    assert_on_screen_above(page, dialog.get_by_text("invalid spec: ps=1 is invalid"), trigger)
    page.screenshot(path=str(ARTIFACTS / "trigger_form_error.png"))
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
    page.screenshot(path=str(ARTIFACTS / "finished_run.png"))
    yield page, run
    page.close()


@pytest.fixture(scope="module")
def mlflow_client(stack):
    from mlflow import MlflowClient

    return MlflowClient(stack["state"]["mlflow_url"])  # through the MLflow server, as the UI reads it


@pytest.fixture(scope="module")
def form_mlflow_run(mlflow_client, form_run):
    """The MLflow run of the form's DAG run."""
    _, run = form_run
    [mlflow_run] = mlflow_client.search_runs(
        [mlflow_client.get_experiment_by_name("hetflow").experiment_id],
        filter_string=f"tags.`airflow.run_id` = '{run['dag_run_id']}'",
    )
    return mlflow_run


def test_trigger_form_runs_what_was_typed_and_mlflow_records_it(stack, api, form_run, mlflow_client, form_mlflow_run):
    page, run = form_run
    assert run["state"] == "success", run
    assert {k: run["conf"][k] for k in ("strategy", "workers", "ps", "epochs")} == {
        "strategy": "parameter_server",
        "workers": 2,
        "ps": 1,
        "epochs": 2,
    }
    client, mlflow_run = mlflow_client, form_mlflow_run
    params = mlflow_run.data.params
    assert (params["strategy"], params["workers"], params["ps"], params["epochs"]) == (
        "parameter_server",
        "2",
        "1",
        "2",
    )
    assert {"plots/training_curves.png", "plots/worker_throughput.png", "plots/staleness.png"} <= {
        a.path for a in client.list_artifacts(mlflow_run.info.run_id, "plots")
    }
    # The experiment declares itself a model-training one; runs are named for what they were.
    experiment = client.get_experiment(mlflow_run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development", experiment.tags
    assert re.fullmatch(r"mlp parameter_server 2 workers \+ 1 ps \d\d-\d\d \d\d:\d\d:\d\d", mlflow_run.info.run_name)
    # The figures a reviewer compares first head the run's page, as its description.
    accuracy = mlflow_run.data.metrics["test_accuracy"]
    assert mlflow_run.data.tags["mlflow.note.content"].startswith(f"**test accuracy {accuracy:.4f}** · validation")
    # Its start and end are the pipeline's: from validate_spec to register, not register's logging alone.
    stages = {
        ti["task_id"]: ti
        for ti in api.get(f"/dags/hetflow_train/dagRuns/{run['dag_run_id']}/taskInstances")["task_instances"]
    }
    at = {
        (task, edge): datetime.fromisoformat(stages[task][f"{edge}_date"]).timestamp()
        for task in ("validate_spec", "register")
        for edge in ("start", "end")
    }
    assert at["validate_spec", "start"] <= mlflow_run.info.start_time / 1000 <= at["validate_spec", "end"], at
    assert at["register", "start"] <= mlflow_run.info.end_time / 1000 <= at["register", "end"], at
    # The runs page make up prints opens on the runs, not on MLflow's GenAI view.
    open_runs_page(page, re.search(r"hetflow's runs: (\S+)", stack["up_output"])[1], mlflow_run.info.run_name)
    page.screenshot(path=str(ARTIFACTS / "mlflow_runs.png"))
    info = mlflow_run.info
    page.goto(f"{stack['state']['mlflow_url']}/#/experiments/{info.experiment_id}/runs/{info.run_id}")
    page.get_by_text(f"test accuracy {accuracy:.4f}").first.wait_for()
    page.screenshot(path=str(ARTIFACTS / "mlflow_run_overview.png"))
    plot = "plots/training_curves.png"
    page.goto(f"{stack['state']['mlflow_url']}/#/experiments/{info.experiment_id}/runs/{info.run_id}/artifacts/{plot}")
    page.get_by_text(plot, exact=True).wait_for()
    page.get_by_role("button", name="Close", exact=True).click()  # the MLflow Assistant side panel
    page.screenshot(path=str(ARTIFACTS / "mlflow_run.png"))


def test_mlflow_charts_show_the_key_metrics_first(stack, form_run, form_mlflow_run):
    """The chart view make up links to ("their key metrics") opens hetflow's saved view: its first
    section holds test, validation and training accuracy, then loss, then examples/s; MLflow's own
    Model metrics section (alphabetical, epoch_seconds and export_* first) keeps every other metric."""
    page, _ = form_run
    charts = re.search(r"their key metrics: (\S+)", stack["up_output"])[1]
    assert_key_metrics_first(page, charts, set(form_mlflow_run.data.metrics))
    page.screenshot(path=str(ARTIFACTS / "mlflow_charts.png"))


# The on-screen boxes of each row's values, found in order in the text of ``root`` after its first
# "Compression", whatever elements hold them (a table's cells or a code block's one text).
_TEXT_BOXES = """(root, rows) => {
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    const starts = [];
    let text = "";
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        starts.push([text.length, node]);
        text += node.data;
    }
    const at = (index) => {
        const [start, node] = starts.findLast(([start]) => start <= index);
        return [node, index - start];
    };
    let from = text.indexOf("Compression");
    if (from < 0) return null;
    return rows.map((values) => values.map((value) => {
        const start = text.indexOf(value, from);
        if (start < 0) return null;
        const range = document.createRange();
        range.setStart(...at(start));
        const [last, offset] = at(start + value.length - 1);
        range.setEnd(last, offset + 1);
        const box = range.getBoundingClientRect();
        from = start + value.length;
        return {left: box.left, right: box.right, top: box.top};
    }));
}"""


def _assert_columns_apart(description, rows: dict[str, list[str]]) -> None:
    """Each row's values (``rows``: the artifact's name, then its cells) on one line, at least 12 px
    apart, the number columns' right edges lined up, and all of it in view without scrolling."""
    found = description.evaluate(_TEXT_BOXES, list(rows.values()))
    assert found and all(all(row) for row in found), (rows, found)
    shown = description.bounding_box()
    for values, row in zip(rows.values(), found):
        assert max(box["top"] for box in row) - min(box["top"] for box in row) < 2, (values, row)  # one line
        gaps = [right["left"] - left["right"] for left, right in zip(row, row[1:])]
        assert min(gaps) >= 12, (values, gaps)
        assert row[-1]["right"] <= shown["x"] + shown["width"], (values, row[-1], shown)
    for column in range(1, 7):
        edges = [row[column]["right"] for row in found]
        assert max(edges) - min(edges) < 1, (rows, column, edges)
    # Nothing of it hidden behind a sideways scroll (a code block scrolls where it is too wide).
    assert description.evaluate("root => [...root.querySelectorAll('*')].every(e => e.scrollWidth <= e.clientWidth)")


def test_the_versions_compression_table_shows_in_mlflow_with_its_columns_apart(
    stack, form_run, mlflow_client, form_mlflow_run
):
    """On the version's page, every row of the compression table reads on one line, with its values
    clearly apart (MLflow renders a Markdown table's cells with no padding: its values touched), the
    numbers of a column right-aligned, and the whole table in view."""
    page, run = form_run
    [run_dir] = [
        found.parent for found in (stack["home"] / "runs").glob("*/run_id") if found.read_text() == run["dag_run_id"]
    ]
    exported = json.loads((run_dir / "export.json").read_text())
    [version] = mlflow_client.search_model_versions(
        f"name = 'hetflow-digits' and run_id = '{form_mlflow_run.info.run_id}'"
    )
    page.goto(f"{stack['state']['mlflow_url']}/#/models/{version.name}/versions/{version.version}")
    description = page.get_by_test_id("note-editor-preview-content")
    description.get_by_text("Compression (export.json)").wait_for()
    fractions = ("test_accuracy", "agreement_with_float", "latency_ms", "sparsity")
    rows = {  # as export.json holds them: the name, the sizes, four decimals of the rest, the encoding
        name: [name, str(a["bytes"]), str(a["gzip_bytes"]), *(f"{a.get(key, 0.0):.4f}" for key in fractions)]
        + [a.get("encoding", "dense")]
        for name, a in exported["artifacts"].items()
    }
    assert len(rows) >= 2, rows  # the SavedModel and at least one TFLite variant
    _assert_columns_apart(description, rows)
    description.get_by_text("Compression (export.json)").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "mlflow_version.png"))


def test_train_task_log_shows_per_worker_progress(api, form_run):
    _, run = form_run
    log = api.get(f"/dags/hetflow_train/dagRuns/{run['dag_run_id']}/taskInstances/train/logs/1", full_content=True)
    text = json.dumps(log["content"])
    assert "[worker-0] worker-0 serving at 127.0.0.1:" in text and "[ps-0] ps-0 serving" in text
    assert "[chief-0] Epoch 1/2" in text and "[chief-0] Epoch 2/2" in text and "examples/s" in text


def _task_logs(api: Api, dag_id: str, run_id: str) -> dict[str, list[dict]]:
    """Every task's log entries (try 1) of a DAG run, as the UI's log view reads them."""
    tasks = api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
    return {
        ti["task_id"]: api.get(
            f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{ti['task_id']}/logs/1", full_content=True
        )["content"]
        for ti in tasks
        if ti["try_number"]
    }


def _errors(entries: list[dict]) -> list[str]:
    return [str(entry.get("event")) for entry in entries if entry.get("level") in ("error", "critical")]


def test_a_successful_runs_task_logs_hold_no_error_line(api, form_run):
    _, run = form_run
    logs = _task_logs(api, "hetflow_train", run["dag_run_id"])
    assert set(logs) >= {"validate_spec", "prepare_data", "train", "evaluate", "compress", "export", "register"}
    errors = {task: _errors(entries) for task, entries in logs.items() if _errors(entries)}
    assert not errors, errors


def test_a_failed_runs_task_log_ends_with_one_error_line_naming_stage_and_cause(stack, api):
    # Valid for the form (a folder dataset under an allowed root), refused by validate_spec: no such folder.
    missing = stack["home"] / "data" / "nonexistent" / "images"
    response = api.post("/dags/hetflow_train/dagRuns", {"logical_date": None, "conf": {"dataset": f"folder:{missing}"}})
    assert response.status_code == 200, response.text
    run = api.wait_for_run("hetflow_train", response.json()["dag_run_id"])
    assert run["state"] == "failed", run
    errors = _errors(_task_logs(api, "hetflow_train", run["dag_run_id"])["validate_spec"])
    assert errors, "no ERROR line in validate_spec's log"
    assert errors[-1].startswith("validate_spec failed: SpecError: ") and f"{missing}: no such folder" in errors[-1], (
        errors
    )


def test_the_dag_docs_are_for_users_and_the_retrain_dag_names_both_triggers(stack, api, browser):
    from devstack.stack import password

    page = signed_in(browser, stack["state"]["airflow_url"], password(stack["state"]), "/dags/hetflow_retrain")
    # The header's Schedule is the asset alone: Airflow 3.3 shows an asset-triggered timetable's
    # assets there, never its summary ("Asset or 0 3 * * 0"); the cron is in the Details tab and the docs.
    page.get_by_role("link", name="hetflow://prepared-data", exact=True).first.wait_for()
    docs = dag_docs(page)
    docs.get_by_text("0 3 * * 0").first.wait_for()
    assert "hetflow://prepared-data" in docs.inner_text()
    page.screenshot(path=str(ARTIFACTS / "retrain_docs.png"))
    page.goto(f"{stack['state']['airflow_url']}/dags/hetflow_retrain/details")
    description = page.get_by_test_id("description-row")
    description.get_by_text("0 3 * * 0", exact=False).wait_for()
    assert "prepared data" in description.inner_text()
    # Unpaused, the header's Next Run is the cron's next time: a Sunday, 03:00 UTC.
    assert api.patch("/dags/hetflow_retrain", {"is_paused": False}).status_code == 200
    try:
        run_after = datetime.fromisoformat(api.get("/dags/hetflow_retrain")["next_dagrun_run_after"])
        sunday_3am_utc = (timedelta(0), 6, 3, 0)
        assert (run_after.utcoffset(), run_after.weekday(), run_after.hour, run_after.minute) == sunday_3am_utc
        page.goto(f"{stack['state']['airflow_url']}/dags/hetflow_retrain")
        page.get_by_text("Next Run", exact=True).wait_for()
        page.get_by_text(f"{run_after:%Y-%m-%d}").first.wait_for()
        page.get_by_role("link", name="hetflow://prepared-data", exact=True).first.wait_for()
        page.screenshot(path=str(ARTIFACTS / "retrain_dag.png"))
    finally:
        assert api.patch("/dags/hetflow_retrain", {"is_paused": True}).status_code == 200
    page.close()
    details = api.get("/dags/hetflow_retrain/details")
    assert "0 3 * * 0" in details["description"] and "prepared data" in details["description"], details
    assert "Press **Trigger**" in api.get("/dags/hetflow_train/details")["doc_md"]


def test_updating_the_data_asset_starts_retraining_on_the_champions_spec(api, form_run):
    _, trained = form_run
    assert api.patch("/dags/hetflow_retrain", {"is_paused": False}).status_code == 200
    known = {run["dag_run_id"] for run in api.runs("hetflow_train")}
    [asset] = api.get("/assets", uri_pattern="hetflow://prepared-data")["assets"]
    event = api.post("/assets/events", {"asset_id": asset["id"], "extra": {"why": "new data (test)"}})
    assert event.status_code == 200, event.text
    retrain = wait_for(lambda: api.runs("hetflow_retrain"), 60, interval=2)
    assert retrain and retrain[0]["run_type"] == "asset_triggered", retrain
    # It triggers hetflow_train with the champion's spec: the form run's, the only version so far.
    triggered = wait_for(lambda: [r for r in api.runs("hetflow_train") if r["dag_run_id"] not in known], 90, interval=3)
    assert triggered, api.get(f"/dags/hetflow_retrain/dagRuns/{retrain[0]['dag_run_id']}/taskInstances")
    assert {k: triggered[0]["conf"][k] for k in ("strategy", "workers", "ps", "epochs")} == {
        k: trained["conf"][k] for k in ("strategy", "workers", "ps", "epochs")
    }

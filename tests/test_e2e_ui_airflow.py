"""Airflow as users use it: the stack of ``make up``, the REST API's answer to a bad conf, the trigger
form in headless Chromium and what MLflow recorded of the run it started, the tasks' logs, the DAG
docs, and retraining started by the data Asset. The stack and the form's run: tests/ui_stack.py.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import requests
from conftest import wait_for
from playwright.sync_api import expect
from ui_pages import (
    close_assistant_panel,
    cut_cells,
    dag_docs,
    open_runs_page,
    open_trigger_form,
    signed_in,
    text_field,
    type_into,
)
from ui_stack import ARTIFACTS, SCREENSHOTS, error_lines

pytestmark = pytest.mark.slow


def test_make_up_is_healthy_prints_the_urls_and_how_to_log_in(stack):
    from devstack.stack import health, rss_bytes

    state = stack["state"]
    assert all(status == "healthy" for status in health(state).values()), health(state)
    output = stack["up_output"]
    assert state["airflow_url"] in output and state["mlflow_url"] in output
    assert "log in as admin, password" in output
    runs = rf"{state['mlflow_url']}/#/experiments/\d+/runs\?workflowType=machine_learning"
    assert re.search(f"hetflow's runs: {runs}&viewStateShareKey=hetflow-key-metrics\n", output), output
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


def test_trigger_form_runs_what_was_typed_and_mlflow_records_it(stack, api, form_run, mlflow_client, form_mlflow_run):
    page, run = form_run
    assert run["state"] == "success", run
    # The conf holds what was typed, the numbers typed as text as the numbers they spell, beside the
    # default the form sent as a number.
    assert {k: run["conf"][k] for k in ("strategy", "workers", "ps", "epochs", "devices_per_worker")} == {
        "strategy": "parameter_server",
        "workers": 2,
        "ps": 1,
        "epochs": 2,
        "devices_per_worker": 1,
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
    assert re.fullmatch(r"async 2w\+1ps epochs=2 \d\d:\d\d:\d\d", mlflow_run.info.run_name)
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
    close_assistant_panel(page)
    # hetflow's saved view: the runs table shows each run's test accuracy and training time.
    headers = page.locator("[role=columnheader]")
    for metric in ("test_accuracy", "train_seconds"):
        header = headers.get_by_text(metric, exact=True).first
        header.wait_for()
        shown = header.bounding_box()  # on screen, not past the table's right edge
        assert shown and shown["x"] + shown["width"] <= page.viewport_size["width"], (metric, shown)
    # Each run's whole name (its start time last tells runs of one configuration apart), source and
    # figures at 4 significant digits, none cut (MLflow's default widths cut them all).
    accuracy_cell = page.locator('[role=gridcell][col-id="metrics.`test_accuracy`"]').first
    expect(accuracy_cell).to_have_text(re.compile(r"^0\.\d{1,4}$"))
    assert cut_cells(page) == []
    page.screenshot(path=str(SCREENSHOTS / "mlflow_runs.png"))
    info = mlflow_run.info
    page.goto(f"{stack['state']['mlflow_url']}/#/experiments/{info.experiment_id}/runs/{info.run_id}")
    page.get_by_text(f"test accuracy {accuracy:.4f}").first.wait_for()
    page.screenshot(path=str(ARTIFACTS / "mlflow_run_overview.png"))
    plot = "plots/training_curves.png"
    page.goto(f"{stack['state']['mlflow_url']}/#/experiments/{info.experiment_id}/runs/{info.run_id}/artifacts/{plot}")
    page.get_by_text(plot, exact=True).wait_for()
    close_assistant_panel(page)
    page.screenshot(path=str(SCREENSHOTS / "mlflow_run.png"))


def test_the_dag_runs_page_links_its_mlflow_run(stack, form_run, form_mlflow_run):
    page, run = form_run
    page.goto(f"{stack['state']['airflow_url']}/dags/hetflow_train/runs/{run['dag_run_id']}")
    # The run's note, at the top of its page (written once validate_spec opened the MLflow run).
    link = page.get_by_role("link", name="Open this run in MLflow ↗")
    expect(link).to_be_visible(timeout=60_000)  # the page loads slowly on a busy machine
    info = form_mlflow_run.info
    mlflow_page = f"{stack['state']['mlflow_url']}/#/experiments/{info.experiment_id}/runs/{info.run_id}"
    assert link.get_attribute("href").startswith(mlflow_page), link.get_attribute("href")
    page.screenshot(path=str(ARTIFACTS / "run_note.png"))


# The point at the right end of an element's text, and whether what the browser shows there is that
# element (nothing drawn over it).
_TEXT_END_SHOWN = """(element) => {
    const text = document.createRange();
    text.selectNodeContents(element);
    const box = text.getBoundingClientRect();
    const shown = document.elementFromPoint(box.right - 2, box.top + box.height / 2);
    return element.contains(shown);
}"""


# The texts an alert shows besides its detail lines (Airflow's "{status} {message}" heading), where
# they take up any room on the page.
_HEADINGS_SHOWN = """(alert) => [...alert.querySelectorAll('.chakra-alert__description > .chakra-stack')].flatMap(
    stack => [...stack.childNodes].filter(node => node.nodeType === Node.TEXT_NODE && node.textContent.trim()))
    .filter(node => {
        const text = document.createRange();
        text.selectNodeContents(node);
        const box = text.getBoundingClientRect();
        return box.width * box.height > 0;
    }).map(node => node.textContent)"""


def test_a_refusal_reads_whole_with_nothing_over_it_and_numbers_are_plain_text_boxes(stack, browser):
    from devstack.stack import password

    page = signed_in(browser, stack["state"]["airflow_url"], password(stack["state"]), "/dags/hetflow_train")
    dialog, trigger = open_trigger_form(page)
    dialog.get_by_text("Training", exact=True).click()
    epochs, steps = text_field(dialog, "epochs"), text_field(dialog, "steps_per_epoch")
    # Epochs is drawn as a plain text box: hovered, it looks as it does without its (empty) list of
    # suggestions, not as with one (Chromium's ▼); empty Steps per epoch shows no "Start typing".
    epochs.hover()
    drawn = epochs.screenshot()
    epochs.evaluate("e => { e.dataset.list = e.getAttribute('list'); e.removeAttribute('list'); }")
    assert epochs.screenshot() == drawn
    epochs.evaluate("e => { e.setAttribute('list', e.dataset.list); e.nextElementSibling.append(new Option('40')); }")
    assert epochs.screenshot() != drawn  # what a suggestion list would draw
    epochs.evaluate("e => e.nextElementSibling.replaceChildren()")
    assert steps.evaluate("e => getComputedStyle(e, '::placeholder').color") == "rgba(0, 0, 0, 0)"
    dialog.get_by_text("Data", exact=True).click()
    type_into(text_field(dialog, "dataset"), "mnistt")
    trigger.click()
    line = "invalid spec: dataset='mnistt' is not a TFDS dataset (did you mean mnist?); offline datasets: uci_digits"
    refusal = dialog.get_by_text(line)
    refusal.wait_for()
    alert = dialog.get_by_test_id("error-alert")
    # The alert shows the line and no heading (Airflow heads it "400 Bad Request": drawn at no size),
    # and the line's end is on screen, seen: no toast over it, even with the pointer left on Trigger.
    assert alert.evaluate(_HEADINGS_SHOWN) == [], alert.inner_text()
    # Airflow may draw the toast twice; neither may be seen.
    expect(page.locator("[data-scope=toast][data-type=error]").filter(visible=True)).to_have_count(0)
    assert refusal.evaluate(_TEXT_END_SHOWN)
    assert refusal.evaluate("e => getComputedStyle(e).wordBreak") == "normal"  # lines break between words
    page.screenshot(path=str(ARTIFACTS / "trigger_form_refused_dataset.png"))
    page.close()


def test_train_task_log_shows_per_worker_progress(api, form_run):
    _, run = form_run
    log = api.get(f"/dags/hetflow_train/dagRuns/{run['dag_run_id']}/taskInstances/train/logs/1", full_content=True)
    text = json.dumps(log["content"])
    assert "[worker-0] worker-0 serving at 127.0.0.1:" in text and "[ps-0] ps-0 serving" in text
    assert "[chief-0] Epoch 1/2" in text and "[chief-0] Epoch 2/2" in text and "examples/s" in text


def test_a_successful_runs_task_logs_hold_no_error_line(stack, api, form_run, form_mlflow_run, mlflow_client, tmp_path):
    _, run = form_run
    logs = api.task_logs("hetflow_train", run["dag_run_id"])
    assert set(logs) >= {"validate_spec", "prepare_data", "train", "evaluate", "compress", "export", "register"}
    # The run's MLflow page, as the browser opens it, where a person reading a task's log looks.
    info = form_mlflow_run.info
    page = f"{stack['state']['mlflow_url']}/#/experiments/{info.experiment_id}/runs/{info.run_id}"
    for task in ("validate_spec", "register", "summarize"):
        assert any(page in str(entry.get("event")) for entry in logs[task]), (task, logs[task][-5:])
    errors = {task: error_lines(entries) for task, entries in logs.items() if error_lines(entries)}
    assert not errors, errors
    # Nor TensorFlow's own error lines ("E0000 ... failed call to cuInit", a replica's, relayed at
    # INFO) or its probing for CUDA on this machine without a GPU, at any level; nor in the replicas'
    # logs the run keeps in MLflow.
    tensorflow_noise = re.compile(r"(^|\] )[EF]\d{4} |cuInit|Could not find cuda drivers")
    lines = [f"{task}: {entry.get('event')}" for task, entries in logs.items() for entry in entries]
    noisy = [line for line in lines if tensorflow_noise.search(line)]
    assert not noisy, noisy
    replica_logs = Path(mlflow_client.download_artifacts(form_mlflow_run.info.run_id, "logs", str(tmp_path)))
    assert sorted(path.name for path in replica_logs.glob("*.log")) == [
        "chief-0.log",
        "ps-0.log",
        "worker-0.log",
        "worker-1.log",
    ]
    for replica_log in replica_logs.glob("*.log"):
        assert not tensorflow_noise.search(replica_log.read_text()), (replica_log.name, replica_log.read_text()[:3000])
    # Nor a warning of ours: MLflow's for a predict without type hints, TFLite's for the calibrated
    # input's statistics; and never a terminal's escape code.
    warnings = {
        task: [str(entry.get("event")) for entry in entries if entry.get("level") == "warning"]
        for task, entries in logs.items()
    }
    for warned in ("Add type hints to the `predict` method", "Statistics for quantized inputs"):
        assert not [line for lines in warnings.values() for line in lines if warned in line], warnings
    assert "\\u001b" not in json.dumps(logs), "an escape code in a task log"  # ESC, as JSON writes it


def test_a_failed_runs_task_log_ends_with_one_error_line_naming_stage_and_cause(stack, api):
    # Valid for the form (a folder dataset under an allowed root), refused by validate_spec: no such folder.
    missing = stack["home"] / "data" / "nonexistent" / "images"
    response = api.post("/dags/hetflow_train/dagRuns", {"logical_date": None, "conf": {"dataset": f"folder:{missing}"}})
    assert response.status_code == 200, response.text
    run = api.wait_for_run("hetflow_train", response.json()["dag_run_id"])
    assert run["state"] == "failed", run
    errors = error_lines(api.task_logs("hetflow_train", run["dag_run_id"])["validate_spec"])
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
        page.screenshot(path=str(SCREENSHOTS / "retrain_dag.png"))
    finally:
        assert api.patch("/dags/hetflow_retrain", {"is_paused": True}).status_code == 200
    page.close()
    details = api.get("/dags/hetflow_retrain/details")
    assert "0 3 * * 0" in details["description"] and "prepared data" in details["description"], details
    assert "Press **Trigger**" in api.get("/dags/hetflow_train/details")["doc_md"]


def test_the_tune_form_shows_the_search_space_and_the_study_and_starts_nothing_on_bad_values(stack, api, browser):
    from devstack.stack import password

    page = signed_in(browser, stack["state"]["airflow_url"], password(stack["state"]), "/dags/hetflow_tune")
    dialog, trigger = open_trigger_form(page)
    dialog.get_by_text("Study", exact=True).first.wait_for()
    dialog.get_by_text("Search space", exact=True).first.click()  # sections open collapsed
    dialog.get_by_text("Distribution strategy: the values the study tries").first.wait_for()
    page.screenshot(path=str(SCREENSHOTS / "tune_form.png"))
    # The study's own fields are titled and explained as the train form's are, not by their keys.
    dialog.get_by_text("Study", exact=True).first.click()
    dialog.get_by_text("The validation accuracy each trial races to.").wait_for()
    labels = [label.strip(" *\n") for label in dialog.locator("label").all_inner_texts()]
    titles = ["Target accuracy", "Trials", "Time budget (seconds)", "Trials at once", "Every trial's spec"]
    assert all(title in labels for title in titles), labels
    assert not {"target_accuracy", "budget_seconds", "parallel_trials", "base"} & set(labels), labels
    page.screenshot(path=str(ARTIFACTS / "tune_form_study.png"))
    page.close()
    # validate_study refuses in one line each before any trial; the study's run fails there.
    response = api.post("/dags/hetflow_tune/dagRuns", {"logical_date": None, "conf": {"trials": 0}})
    assert response.status_code == 200, response.text
    run = api.wait_for_run("hetflow_tune", response.json()["dag_run_id"])
    assert run["state"] == "failed"
    errors = error_lines(api.task_logs("hetflow_tune", run["dag_run_id"])["validate_study"])
    assert errors[-1] == (
        "validate_study failed: SpecError: trials=0 is invalid: expected an integer >= 1 and <= 200"
    ), errors
    states = {
        ti["task_id"]: ti["state"]
        for ti in api.get(f"/dags/hetflow_tune/dagRuns/{run['dag_run_id']}/taskInstances")["task_instances"]
    }
    assert states["run_study"] == "upstream_failed", states


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
    from hetflow.spec import parse_spec

    triggered = wait_for(lambda: [r for r in api.runs("hetflow_train") if r["dag_run_id"] not in known], 90, interval=3)
    assert triggered, api.get(f"/dags/hetflow_retrain/dagRuns/{retrain[0]['dag_run_id']}/taskInstances")
    trained_spec = parse_spec(trained["conf"]).flat()
    assert {k: triggered[0]["conf"][k] for k in ("strategy", "workers", "ps", "epochs")} == {
        k: trained_spec[k] for k in ("strategy", "workers", "ps", "epochs")
    }

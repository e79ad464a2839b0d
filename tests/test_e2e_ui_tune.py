"""A tuning study as users see it on the stack of ``make up`` (tests/ui_stack.py): hetflow_tune
triggered through the REST API runs its two trials side by side and registers the best one; its run
in Airflow's grid, the study's parent run in MLflow with its trials nested, both in Chromium."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import quote

import pytest
from playwright.sync_api import expect
from ui_pages import close_assistant_panel, signed_in
from ui_stack import SCREENSHOTS, error_lines

pytestmark = pytest.mark.slow


def test_a_study_trains_its_trials_side_by_side_and_registers_the_best_one(
    stack, api, browser, mlflow_client, study_run, tmp_path
):
    from devstack.stack import password

    run_id = study_run["dag_run_id"]
    assert study_run["state"] == "success"
    logs = api.task_logs("hetflow_tune", run_id)
    assert {task: error_lines(entries) for task, entries in logs.items()} == {task: [] for task in logs}
    # Both trials' replicas in run_study's one log, each line naming its trial.
    lines = [str(entry.get("event")) for entry in logs["run_study"]]
    assert all(any(line.startswith(f"[trial-{n} worker-0] ") for line in lines) for n in (0, 1)), lines[-20:]
    # The study and its trials in words, figures rounded (not Python's dicts and 17-digit floats).
    settings = [line for line in lines if re.match(r"trial \d+: ", line)]
    assert len(settings) == 2 and all("{" not in line and "strategy=" in line for line in settings), settings
    outcomes = [line for line in lines if re.match(r"trial \d+ complete: ", line)]
    ended = (
        r"trial \d complete: validation accuracy 0\.\d+ (reached \d+\.\d s after launch|not reached \(best 0\.\d{4}\))"
    )
    assert len(outcomes) == 2 and all(re.fullmatch(ended, line) for line in outcomes), outcomes
    [study] = [str(e.get("event")) for e in logs["validate_study"] if str(e.get("event")).startswith("study: ")]
    assert "{" not in study and " trials, 2 at a time, to validation accuracy " in study, study

    experiment = mlflow_client.get_experiment_by_name("hetflow").experiment_id
    (parent,) = mlflow_client.search_runs([experiment], f"tags.`airflow.run_id` = '{run_id}'")
    assert parent.info.status == "FINISHED" and parent.data.tags["airflow.dag_id"] == "hetflow_tune"
    assert parent.data.params["parallel_trials"] == "2"
    table = json.loads(Path(mlflow_client.download_artifacts(parent.info.run_id, "trials.json", tmp_path)).read_text())
    assert table["state"] == ["complete", "complete"], table
    reached = [i for i, seconds in enumerate(table["launch_to_target_seconds"]) if seconds is not None]
    assert reached, table
    best = min(reached, key=lambda i: table["launch_to_target_seconds"][i])
    artifacts = {a.path for a in mlflow_client.list_artifacts(parent.info.run_id, "comparison")}
    assert artifacts == {"comparison/time_to_target.png", "comparison/sync_vs_async.png"}
    note = parent.data.tags["mlflow.note.content"]  # the trials at the top of the study's page
    assert all(f"\n{number}  " in note for number in table["trial"]) and "to target s" in note
    children = mlflow_client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.data.tags["airflow.run_id"] for c in children) == sorted(table["run_id"])
    assert {c.data.tags["tuning.state"] for c in children} == {"complete"}
    assert {c.data.params["strategy"] for c in children} <= {"multi_worker_mirrored", "parameter_server"}
    assert all(mlflow_client.get_metric_history(c.info.run_id, "val_accuracy") for c in children)
    # Side by side: each trial's run started before the other's ended.
    assert max(c.info.start_time for c in children) < min(c.info.end_time for c in children)
    # The winner's versions (the float model, its TFLite file) carry the study and the trial.
    winner = next(c for c in children if c.data.tags["airflow.run_id"] == table["run_id"][best])
    versions = mlflow_client.search_model_versions("name = 'tuned-digits'")
    assert versions and {(v.tags["tuning.study"], v.tags["tuning.trial"], v.run_id) for v in versions} == {
        (run_id, str(table["trial"][best]), winner.info.run_id)
    }

    state = stack["state"]
    grid = f"/dags/hetflow_tune/runs/{quote(run_id, safe='')}"
    page = signed_in(browser, state["airflow_url"], password(state), grid)
    page.get_by_text("run_study").first.wait_for()
    # The study's parent run, linked at the top of its Airflow run's page (the run's note).
    link = page.get_by_role("link", name="Open this study in MLflow ↗")
    expect(link).to_be_visible(timeout=60_000)
    assert link.get_attribute("href").startswith(
        f"{state['mlflow_url']}/#/experiments/{experiment}/runs/{parent.info.run_id}"
    ), link.get_attribute("href")
    page.screenshot(path=str(SCREENSHOTS / "tune_run.png"))
    page.close()
    # The study's MLflow page opens on its trials table (its description).
    study_page = browser.new_page(viewport={"width": 1400, "height": 1000})
    study_page.goto(f"{state['mlflow_url']}/#/experiments/{experiment}/runs/{parent.info.run_id}")
    close_assistant_panel(study_page)
    expect(study_page.get_by_text("to target s").first).to_be_visible(timeout=60_000)
    study_page.screenshot(path=str(SCREENSHOTS / "mlflow_study_run.png"))
    study_page.close()

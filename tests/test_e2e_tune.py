"""End to end: `hetflow tune` drives the hetflow_tune DAG through Airflow: real trials (two side by
side), the best one evaluated, compressed, exported and registered; the study and its trials read
back from MLflow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TUNE_STUDY

pytestmark = pytest.mark.slow


def tune(env, tmp_path, study: dict, *sets: str) -> subprocess.CompletedProcess:
    config = tmp_path / "study.json"
    config.write_text(json.dumps(study))
    args = [sys.executable, "-m", "hetflow.cli.main", "tune", "--config", str(config)]
    for assignment in sets:
        args += ["--set", assignment]
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_bad_study_values_are_refused_in_one_line_each_before_anything_starts(hetflow_env, tmp_path):
    runs = Path(hetflow_env["HETFLOW_HOME"]) / "runs"
    before = set(runs.iterdir()) if runs.exists() else set()
    done = tune(hetflow_env, tmp_path, {**TUNE_STUDY, "trials": 0}, "epochs=-1")
    assert done.returncode == 2
    problems = [line for line in done.stderr.splitlines() if line.startswith("hetflow: invalid spec: ")]
    assert len(problems) == 2, done.stderr
    assert any("trials=0 is invalid: expected an integer >= 1 and <= 200" in line for line in problems)
    assert any("base: epochs=-1 is invalid: expected an integer >= 1 and <= 1000" in line for line in problems)
    assert (set(runs.iterdir()) if runs.exists() else set()) == before


# make test runs a study through the DAG on make up's stack (test_e2e_ui_tune.py); this one, `hetflow
# tune`'s, in make test-all.
@pytest.mark.heavy
def test_a_study_runs_its_trials_and_registers_the_best_one(hetflow_env, tmp_path):
    from mlflow import MlflowClient

    done = tune(hetflow_env, tmp_path, TUNE_STUDY)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary_path = done.stdout.strip().splitlines()[-1].split()[-1]
    summary = json.loads(open(summary_path).read())
    trials = summary["trials"]
    assert [t["state"] for t in trials] == ["complete", "complete"]
    # Side by side (parallel_trials): each started before the other ended.
    assert max(t["started_at"] for t in trials) < min(t["ended_at"] for t in trials), trials
    # Their replicas' lines, in the one task log they share, say which trial they are from.
    log = max((Path(hetflow_env["HETFLOW_HOME"]) / "logs").glob("hetflow-tune-*.log"), key=lambda p: p.stat().st_mtime)
    assert all(f"[trial-{t['number']} worker-0] " in log.read_text() for t in trials)
    assert {t["params"]["strategy"] for t in trials} <= {"multi_worker_mirrored", "parameter_server"}
    reached = [t for t in trials if t["launch_to_target_seconds"] is not None]
    assert reached, trials
    best = min(reached, key=lambda t: t["launch_to_target_seconds"])
    assert summary["best_run_id"] == best["run_id"]

    client = MlflowClient(hetflow_env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("hetflow").experiment_id
    (parent,) = client.search_runs([experiment], f"tags.`airflow.run_id` = '{summary['run_id']}'")
    assert parent.info.status == "FINISHED" and parent.data.tags["airflow.dag_id"] == "hetflow_tune"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "comparison")}
    assert artifacts == {"comparison/time_to_target.png", "comparison/sync_vs_async.png"}
    assert "trials.json" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    table = parent.data.tags["mlflow.note.content"]  # the trials at the top of the study's page
    assert all(f"\n{t['number']}  " in table for t in trials) and "to target s" in table
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.data.tags["airflow.run_id"] for c in children) == sorted(t["run_id"] for t in trials)
    for child in children:
        assert child.data.tags["tuning.state"] == "complete"
        assert len(client.get_metric_history(child.info.run_id, "val_accuracy")) >= 1
    version = client.get_model_version("tuned-digits", str(summary["registry"]["version"]))
    assert version.tags["tuning.study"] == summary["run_id"]
    assert version.tags["tuning.trial"] == str(summary["best_trial"])
    winner = next(c for c in children if c.data.tags["airflow.run_id"] == summary["best_run_id"])
    assert version.run_id == winner.info.run_id

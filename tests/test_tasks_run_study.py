"""A tuning study on real clusters: a trial behind the earlier ones is pruned (its replicas stopped
and torn down), a study whose task is killed mid-trial resumes on retry, running the interrupted
trial again once and no other trial twice, and a SIGTERM to a study whose trials train side by side
stops every trial's replicas and leaves each trial for the retry to run again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

# Long enough to be killed mid-trial (mlp does not reach 0.99): a few seconds of epochs a trial.
BASE = {"model": "mlp", "epochs": 15}


def make_study(run_id: str, **values) -> None:
    from hetflow.tasks.validate_study import validate_study

    validate_study({"base": BASE, "target_accuracy": 0.99, **values}, run_id)


def test_a_trial_behind_the_earlier_ones_is_pruned_and_torn_down(hetflow_env):
    import optuna

    from hetflow.cluster.processes import run_processes
    from hetflow.paths import run_paths
    from hetflow.tuning import study as tuning
    from hetflow.tuning.space import StudySpec
    from hetflow.tuning.trial import run_trial

    run_id = f"study-pruned-{os.getpid()}"
    make_study(run_id, trials=3, choices={"strategy": ["multi_worker_mirrored"], "workers": [2]})
    spec = StudySpec.model_validate_json(run_paths(run_id).study.read_text())
    study = tuning.load(run_id, spec)
    # Two earlier trials that were at the target from their first seconds (steps of STEP_SECONDS).
    for _ in range(tuning.PRUNER_STARTUP_TRIALS):
        study.add_trial(
            optuna.trial.create_trial(
                params={"strategy": "multi_worker_mirrored", "workers": 2},
                distributions={
                    "strategy": optuna.distributions.CategoricalDistribution(["multi_worker_mirrored"]),
                    "workers": optuna.distributions.CategoricalDistribution([2]),
                },
                value=1.0,
                intermediate_values={step: 0.0 for step in range(200)},
                user_attrs={"run_id": "earlier"},
            )
        )
    study.optimize(lambda trial: run_trial(trial, spec, run_id, None), n_trials=1)
    (real,) = [t for t in study.trials if t.user_attrs["run_id"] != "earlier"]
    assert real.state == optuna.trial.TrialState.PRUNED
    assert real.user_attrs["state"] == "pruned" and "behind the median" in real.user_attrs["reason"]
    trial_run = real.user_attrs["run_id"]
    assert run_processes(trial_run) == []
    assert not run_paths(trial_run).training.exists()  # stopped before training ended

    from mlflow import MlflowClient

    client = MlflowClient(hetflow_env["MLFLOW_TRACKING_URI"])
    (trial_run_record,) = client.search_runs(
        [client.get_experiment_by_name("hetflow").experiment_id], f"tags.`airflow.run_id` = '{trial_run}'"
    )
    assert trial_run_record.info.status == "KILLED" and trial_run_record.data.tags["tuning.state"] == "pruned"
    assert "failed_task" not in trial_run_record.data.tags  # pruned is what the study asked for, no failure


_RUN_STUDY = """
import sys
from hetflow.tasks.run_study import run_study
run_study(sys.argv[1])
"""


def test_a_study_killed_mid_trial_resumes_and_runs_no_trial_twice(hetflow_env):
    import optuna

    from hetflow.cluster.processes import run_processes
    from hetflow.paths import run_paths
    from hetflow.tasks.run_study import run_study
    from hetflow.tuning import study as tuning
    from hetflow.tuning.space import StudySpec

    run_id = f"study-resumed-{os.getpid()}"
    make_study(run_id, trials=2, ranges={"learning_rate": [0.001, 0.01]})
    task = subprocess.Popen(
        [sys.executable, "-c", _RUN_STUDY, run_id], cwd=REPO, env=hetflow_env, start_new_session=True
    )
    first_trial = run_paths(f"{run_id}.trial-0")
    try:
        deadline = time.monotonic() + 300
        while not (first_trial.progress.exists() and first_trial.progress.read_text().count("\n") >= 2):
            assert task.poll() is None and time.monotonic() < deadline, "trial 0 never trained"
            time.sleep(0.5)
    finally:
        os.killpg(task.pid, signal.SIGKILL)  # the task's process is gone at once: no clean-up of its own
        task.wait()
    deadline = time.monotonic() + 30  # local replicas end with their supervisor's lease
    while run_processes(f"{run_id}.trial-0") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert run_processes(f"{run_id}.trial-0") == []

    best = run_study(run_id)  # the retry

    study = tuning.load(run_id, StudySpec.model_validate_json(run_paths(run_id).study.read_text()))
    states = [(t.number, t.state, t.user_attrs.get("retry_of")) for t in study.trials]
    failed, rerun, other = study.trials
    assert failed.state == optuna.trial.TrialState.FAIL  # the killed one, never finished
    assert rerun.user_attrs["retry_of"] == 0 and rerun.params == failed.params, states
    assert rerun.state == other.state == optuna.trial.TrialState.COMPLETE, states
    trials = json.loads(run_paths(run_id).trials.read_text())
    assert [t["number"] for t in trials] == [1, 2] and best["trials"] == 2
    assert best["best_run_id"] in {f"{run_id}.trial-1", f"{run_id}.trial-2"}


def _training(run_id: str) -> bool:
    """Whether the run's chief has reported two epochs."""
    from hetflow.paths import run_paths

    progress = run_paths(run_id).progress
    return progress.exists() and progress.read_text().count("\n") >= 2


def test_a_sigterm_stops_every_trial_of_a_study_training_side_by_side(hetflow_env):
    import optuna

    from hetflow.cluster.processes import run_processes
    from hetflow.paths import run_paths
    from hetflow.tuning import study as tuning
    from hetflow.tuning.space import StudySpec

    run_id = f"study-sigterm-{os.getpid()}"
    # Trials far from their end when stopped: neither may finish while the other is still starting.
    base = {**BASE, "epochs": 200}
    make_study(
        run_id, base=base, target_accuracy=1.0, trials=2, parallel_trials=2, ranges={"learning_rate": [1e-3, 1e-2]}
    )
    trials = [f"{run_id}.trial-{number}" for number in (0, 1)]
    task = subprocess.Popen(
        [sys.executable, "-c", _RUN_STUDY, run_id], cwd=REPO, env=hetflow_env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while not all(_training(trial) for trial in trials):  # both at once: side by side
            assert task.poll() is None and time.monotonic() < deadline, "the two trials never trained together"
            time.sleep(0.5)
        task.send_signal(signal.SIGTERM)  # Airflow stopping the task: to its process alone
        task.wait(timeout=20)  # Airflow's SIGKILL comes 5 s after; the teardown is quicker
    finally:
        if task.poll() is None:
            os.killpg(task.pid, signal.SIGKILL)
            task.wait()
    assert task.returncode != 0
    assert [run_processes(trial) for trial in trials] == [[], []]

    study = tuning.load(run_id, StudySpec.model_validate_json(run_paths(run_id).study.read_text()))
    assert [(t.state, t.user_attrs.get("interrupted")) for t in study.trials] == [
        (optuna.trial.TrialState.FAIL, True)
    ] * 2
    assert sorted(tuning.retry_interrupted(study)) == [0, 1]  # the retry runs both again

"""run_study: the tuning study's trials, one at a time or ``parallel_trials`` at once (threads, each
supervising a cluster of its own), each a real cluster run (provision, train, teardown) with its own
run directory and MLflow run; pruned trials stopped early; resumed where an earlier try of this task
stopped. Returns the best trial, whose model the DAG carries on."""

from __future__ import annotations

import logging
import time
from typing import Any

from hetflow.paths import run_paths, write_record
from hetflow.pipeline.attempts import reported
from hetflow.pipeline.interrupt import replicas_stopped_on_sigterm
from hetflow.tuning import report
from hetflow.tuning import study as tuning
from hetflow.tuning.space import StudySpec, settings_words
from hetflow.tuning.trial import run_trial, trial_record

log = logging.getLogger("hetflow.stages")


@reported
def run_study(run_id: str, airflow_url: str | None = None) -> dict[str, Any]:
    """Run the trials still owed (within the study's trials and wall-time budget); write
    ``trials.json``; return the best trial that reached the target, else the most accurate."""
    paths = run_paths(run_id)
    spec = StudySpec.model_validate_json(paths.study.read_text())
    study = tuning.load(run_id, spec)
    for number in tuning.retry_interrupted(study):
        log.info("trial %d was interrupted by an earlier try of this task: it runs again", number)
    if "started_at" not in study.user_attrs:
        study.set_user_attr("started_at", time.time())
    owed = spec.trials - len(tuning.finished_trials(study))
    budget_left = spec.budget_seconds - (time.time() - study.user_attrs["started_at"])
    if owed > 0 and budget_left > 0:
        log.info(
            "running %d trial(s), %d at a time, %.0f s of the budget left", owed, spec.parallel_trials, budget_left
        )
        # Every trial is this task's own: a SIGTERM stops the replicas of all of them; trials in
        # threads end Interrupted (a retry runs them again) before this task ends.
        with replicas_stopped_on_sigterm(interrupt_here=spec.parallel_trials == 1):
            study.optimize(
                lambda trial: run_trial(trial, spec, run_id, airflow_url),
                n_trials=owed,
                timeout=budget_left,
                n_jobs=spec.parallel_trials,
                catch=(tuning.TrialFailed,),
            )
    trials = [trial_record(trial) for trial in tuning.finished_trials(study)]
    write_record(paths.trials, trials)
    report.report_study(paths, trials, spec.target_accuracy)
    ranked = sorted((t for t in trials if t["state"] == "complete"), key=lambda t: t["value"])
    if not ranked:
        raise tuning.TrialFailed(f"no trial of the {len(trials)} run finished training: {paths.trials} says why")
    best = ranked[0]
    log.info(
        "best: trial %d (%s), %s",
        best["number"],
        settings_words(best["params"]),
        tuning.outcome_words(best, spec.target_accuracy),
    )
    return {"best_run_id": best["run_id"], "best_trial": best["number"], "trials": len(trials)}

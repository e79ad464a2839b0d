"""finish_study: the study's summary, the registered versions of its winner tagged with the study and
trial they came from, and the study's MLflow run ended."""

from __future__ import annotations

import logging
from typing import Any

from hetflow.paths import run_paths, write_record
from hetflow.pipeline.attempts import read_record, reported

log = logging.getLogger("hetflow.stages")


@reported
def finish_study(run_id: str, best: dict[str, Any]) -> dict[str, Any]:
    """Write the study's ``summary.json``; tag each version the winner registered."""
    from hetflow.records import EvaluationRecord
    from hetflow.registry.live import tracked_run
    from hetflow.tuning.report import report_winner

    paths = run_paths(run_id)
    trials = read_record(paths.trials)
    winner = run_paths(best["best_run_id"])
    registry = read_record(winner.registry)
    report_winner(paths, best["best_trial"], registry, EvaluationRecord.read(winner).test_accuracy)
    study = tracked_run(paths)
    if study is not None:
        client, study_run = study
        for model in registry["models"]:
            for key, value in (("tuning.study", run_id), ("tuning.trial", str(best["best_trial"]))):
                client.set_model_version_tag(model["model_name"], str(model["version"]), key, value)
        client.set_tag(study_run, "tuning.best_run_id", best["best_run_id"])
        client.set_terminated(study_run, "FINISHED")
    summary = {
        "status": "success",
        "run_id": run_id,
        "best_trial": best["best_trial"],
        "best_run_id": best["best_run_id"],
        "trials": [{k: v for k, v in trial.items() if k != "curve"} for trial in trials],
        "registry": {key: registry[key] for key in ("model_name", "version", "aliases", "gate")},
    }
    write_record(paths.summary, summary)
    log.info(
        "study %s: trial %d registered as %s v%s",
        run_id,
        best["best_trial"],
        registry["model_name"],
        registry["version"],
    )
    return summary

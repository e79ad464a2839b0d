"""One trial of a tuning study: a real run of its own (validate, prepare, provision, train with the
pruner watching, teardown whatever happened), its MLflow run nested under the study's, and what
Optuna and the study's report keep of it. The pipeline's stages, run in order as `hetflow train`
runs them."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import optuna

from hetflow.paths import run_paths
from hetflow.tuning import report
from hetflow.tuning import study as tuning
from hetflow.tuning.space import StudySpec, settings_words

log = logging.getLogger("hetflow.stages")
# A trial's checks and data, one trial at a time (its cluster then trains beside the others'):
# tensorflow_datasets' lazy imports are not thread-safe, and two trials preparing at once failed
# with "TypeError: 'LazyModule' object is not callable".
_ONE_TRIAL_AT_A_TIME = threading.Lock()


def trial_record(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    states = {optuna.trial.TrialState.COMPLETE: "complete", optuna.trial.TrialState.PRUNED: "pruned"}
    attributes = trial.user_attrs
    return {
        "number": trial.number,
        "state": states.get(trial.state, "failed"),
        "params": trial.params,
        "value": trial.value,
        "run_id": attributes.get("run_id"),
        "launch_to_target_seconds": attributes.get("launch_to_target_seconds"),
        "best_accuracy": attributes.get("best_accuracy", 0.0),
        "wall_seconds": attributes.get("wall_seconds", 0.0),
        # When Optuna started and finished it (unix seconds): trials side by side overlap.
        "started_at": trial.datetime_start.timestamp() if trial.datetime_start else None,
        "ended_at": trial.datetime_complete.timestamp() if trial.datetime_complete else None,
        "curve": attributes.get("curve", []),
        "reason": attributes.get("reason"),
        **({"retry_of": attributes["retry_of"]} if "retry_of" in attributes else {}),
    }


def run_trial(trial: optuna.Trial, spec: StudySpec, study_id: str, airflow_url: str | None) -> float:
    """One trial, start to teardown: its objective value, or TrialPruned / TrialFailed."""
    from hetflow.cluster.supervisor import ReplicaFailed
    from hetflow.pipeline.attempts import load_spec
    from hetflow.pipeline.interrupt import Interrupted
    from hetflow.pipeline.progress import StoppedEarly
    from hetflow.records import DatasetRecord
    from hetflow.replica.training_json import read_training
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.provision_cluster import provision_cluster
    from hetflow.tasks.teardown_cluster import teardown_cluster
    from hetflow.tasks.train import train
    from hetflow.tasks.validate_spec import validate_spec

    values = spec.trial_values(tuning.draw(trial, spec))
    trial_run = f"{study_id}.trial-{trial.number}"
    trial.set_user_attr("run_id", trial_run)
    log.info("trial %d: %s", trial.number, settings_words(trial.params))
    trial_paths = run_paths(trial_run)
    pruner = tuning.Pruner(trial, time.time())
    record: dict[str, Any] = {"state": "failed", "reason": None, "launch_to_target_seconds": None}
    try:
        tuning.check_trial_spec(values)
        with _ONE_TRIAL_AT_A_TIME:
            validate_spec(values, trial_run, dag_id=tuning.TUNE_DAG, airflow_url=airflow_url)
            report.nest_trial(trial_paths, run_paths(study_id), study_id, trial.number)
            prepare_data(trial_run)
        pruner.launched = time.time()
        try:
            provision_cluster(trial_run)
            train(trial_run, watchers=[pruner], log_label=f"trial-{trial.number}")
        finally:
            teardown_cluster(trial_run)
        training = read_training(trial_paths.training, load_spec(trial_paths), DatasetRecord.read(trial_paths))
        value, record["launch_to_target_seconds"] = tuning.objective_value(
            spec, training, time.time() - pruner.launched
        )
        record["state"] = "complete"
        return value
    except StoppedEarly as stopped:
        record.update(state="pruned", reason=str(stopped))
        raise optuna.TrialPruned(str(stopped)) from None
    except Interrupted:
        trial.set_user_attr("interrupted", True)
        raise
    except (ReplicaFailed, tuning.TrialFailed) as failed:
        record["reason"] = str(failed).splitlines()[0][:500]
        raise tuning.TrialFailed(record["reason"]) from None
    except Exception as error:  # not the trial's own fault: said in its record, and raised on
        record["reason"] = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        raise
    finally:
        record.update(
            best_accuracy=pruner.best_accuracy, wall_seconds=time.time() - pruner.launched, curve=pruner.curve
        )
        for key, value in record.items():
            trial.set_user_attr(key, value)
        if trial_paths.tracking.exists():
            report.end_trial(trial_paths, record)
        log.info("trial %d %s", trial.number, tuning.outcome_words(record, spec.target_accuracy))

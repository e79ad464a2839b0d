"""A tuning study, run: Optuna's TPE sampler draws each trial's settings; each trial is a real run
of its own (validate, prepare, provision, train, teardown; its own run directory and MLflow run,
nested under the study's); its validation accuracy goes to Optuna as the epochs come, and Optuna's
median rule prunes a trial that is behind the trials before it at the same wall-clock time since
launch (its replicas stopped, its cluster torn down).

The objective is the time from launch to the target validation accuracy (the training record's
``target_reached_at - launched_at``); a trial that never reaches it scores more than any that does,
ranked by its best accuracy. The study lives in ``$HETFLOW_HOME/tuning/studies.db``: a retried
task resumes it, re-running once (same settings) a trial that was interrupted, and runs only the
trials still owed, so none is run twice or lost."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from hetflow.paths import hetflow_home
from hetflow.replica.training_json import TrainingRecord
from hetflow.spec import SpecError, parse_spec
from hetflow.tuning.space import INTEGER_RANGES, StudySpec

log = logging.getLogger("hetflow.stages")

TUNE_DAG = "hetflow_tune"
# Optuna compares trials at the same step: a step is this many seconds since the trial's launch.
STEP_SECONDS = 5
# The median rule waits for this many finished trials before it prunes any.
PRUNER_STARTUP_TRIALS = 2


class TrialFailed(RuntimeError):
    """A trial that ended without a result (its spec, its replicas): recorded, and the study goes on."""


def storage_url() -> str:
    folder = hetflow_home() / "tuning"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'studies.db'}"


def load(study_id: str, spec: StudySpec) -> optuna.Study:
    """The study of this name, created on first use with its sampler and pruner."""
    storage = optuna.storages.RDBStorage(storage_url(), engine_kwargs={"connect_args": {"timeout": 60}})
    pruner = (
        optuna.pruners.MedianPruner(n_startup_trials=PRUNER_STARTUP_TRIALS, n_warmup_steps=0)
        if spec.pruning
        else optuna.pruners.NopPruner()
    )
    return optuna.create_study(
        storage=storage,
        study_name=study_id,
        direction="minimize",
        # TPE models the trials after a third of the budget drawn at random (its default waits for 10).
        sampler=optuna.samplers.TPESampler(seed=spec.seed, n_startup_trials=max(2, spec.trials // 3)),
        pruner=pruner,
        load_if_exists=True,
    )


def draw(trial: optuna.Trial, spec: StudySpec) -> dict[str, Any]:
    """The trial's settings: each choice and range of the study (balance_batches only beside
    multi_worker_mirrored, the one strategy it applies to)."""
    drawn: dict[str, Any] = {}
    for key, options in spec.choices.items():
        if key == "balance_batches" and spec.trial_values(drawn).get("strategy") != "multi_worker_mirrored":
            continue
        drawn[key] = trial.suggest_categorical(key, options)
    for key, (low, high) in spec.ranges.items():
        if key in INTEGER_RANGES:
            drawn[key] = trial.suggest_int(key, int(low), int(high), log=True)
        elif key == "learning_rate":
            drawn[key] = trial.suggest_float(key, low, high, log=True)
        else:
            drawn[key] = trial.suggest_float(key, low, high)
    return drawn


def finished_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that count against the budget: complete, pruned, or failed for a reason of their own
    (an interrupted trial is run again, and its rerun counts)."""
    retried = {t.user_attrs.get("retry_of") for t in study.trials}
    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return [t for t in study.trials if t.state in done and t.number not in retried]


def retry_interrupted(study: optuna.Study) -> list[int]:
    """Queue again, once, each trial an earlier try of the task left unfinished (still RUNNING: its
    process was killed) or interrupted (Airflow's SIGTERM); returns their numbers."""
    retried = {t.user_attrs.get("retry_of") for t in study.trials}
    queued = []
    for trial in study.trials:
        interrupted = trial.state == TrialState.RUNNING or trial.user_attrs.get("interrupted")
        if interrupted and trial.number not in retried:
            if trial.state == TrialState.RUNNING:
                study.tell(trial.number, state=TrialState.FAIL)
            study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
            queued.append(trial.number)
    return queued


@dataclass
class Pruner:
    """A training watcher (``hetflow.pipeline.progress``): reports the trial's validation error so
    far at each ``STEP_SECONDS`` since launch, keeps its curve (seconds, accuracy), and stops
    training when Optuna prunes the trial."""

    trial: optuna.Trial
    launched: float  # unix time, the pipeline's clock
    best_accuracy: float = 0.0
    reported_steps: int = 0
    __name__ = "the tuning study's pruner"

    def __post_init__(self):
        self.curve: list[tuple[float, float]] = []

    def __call__(self, epochs, usage) -> str | None:
        if not epochs:
            return None
        seconds = time.time() - self.launched
        for epoch in epochs:
            accuracy = epoch.figures.get("val_accuracy", 0.0)
            self.best_accuracy = max(self.best_accuracy, accuracy)
            self.curve.append((round(seconds, 2), accuracy))
        step = int(seconds // STEP_SECONDS)
        for at in range(self.reported_steps, step + 1):
            self.trial.report(1.0 - self.best_accuracy, at)
        self.reported_steps = step + 1
        if self.trial.should_prune():
            return (
                f"pruned at {seconds:.0f} s: validation accuracy {self.best_accuracy:.4f} is behind the median "
                f"of earlier trials at that time"
            )
        return None


def objective_value(spec: StudySpec, training: TrainingRecord, launched_wall: float) -> tuple[float, float | None]:
    """(Optuna's value, launch-to-target seconds or None). The record's times are the chief's: they
    are believed only within what the pipeline saw (from before the launch to now)."""
    best = max(training.history.val_accuracy, default=0.0)
    reached = training.target_reached_at
    if reached is not None:
        launch_to_target = reached - training.launched_at
        if 0 <= launch_to_target <= launched_wall:
            return launch_to_target, launch_to_target
    return spec.budget_seconds * (2 + spec.target_accuracy - best), None


def check_trial_spec(values: dict[str, Any]) -> None:
    """TrialFailed, in the spec's words, for a combination no trial can train."""
    try:
        parse_spec(values)
    except SpecError as error:
        raise TrialFailed("; ".join(error.problems)) from None


def outcome_words(record: dict[str, Any], target_accuracy: float) -> str:
    """How a trial ended, in a line: its state, then the target reached and when, or why not."""
    state, reason = record["state"], record["reason"]
    if state != "complete":  # a pruned trial's reason starts "pruned at 15 s"
        return reason if str(reason).startswith(state) else f"{state}: {reason}"
    seconds = record["launch_to_target_seconds"]
    if seconds is None:
        best = record.get("best_accuracy", 0.0)
        return f"complete: validation accuracy {target_accuracy:g} not reached (best {best:.4f})"
    return f"complete: validation accuracy {target_accuracy:g} reached {seconds:.1f} s after launch"

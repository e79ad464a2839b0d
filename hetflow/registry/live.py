"""The MLflow run of a DAG run while it runs: made by its first stage (RUNNING, the spec as params,
tags linking back to the Airflow run), fed by ``train`` with each epoch's figures as the chief
reports them and each replica's CPU and memory as the pipeline samples them, and ended FAILED, with
the failing task and its one-line reason as tags, when a stage fails. ``register`` completes the
same run after training (found again by the Airflow run id).

Only the pipeline writes to MLflow: replicas report through a file (``hetflow.pipeline.progress``),
which the pipeline checks before anything reaches the run. MLflow being away never fails a stage:
the stages warn and go on, and ``register`` logs what is missing."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import requests
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from hetflow.paths import RunPaths, write_record
from hetflow.pipeline import timing
from hetflow.pipeline.progress import Epoch
from hetflow.registry import store
from hetflow.registry.run_record import MAX_METRICS_PER_BATCH, as_computed, run_name
from hetflow.spec import RunSpec
from mlflow import MlflowClient

log = logging.getLogger("hetflow.registry")

_UNREACHABLE = (MlflowException, requests.exceptions.RequestException, OSError)
# The chief's figures as the run names them: register's per-epoch curves have the same names, so a
# run shows one curve whether it was logged live or after training. In the order they are logged:
# MLflow's run page lists a run's metrics (Overview) in the order each first came, accuracy first.
EPOCH_METRICS = {
    "val_accuracy": "val_accuracy",
    "accuracy": "train_accuracy",
    "val_loss": "val_loss",
    "loss": "train_loss",
    "learning_rate": "learning_rate",
    "epoch_seconds": "epoch_seconds",
    "examples_per_second": "epoch_examples_per_second",
    "staleness_mean": "epoch_staleness_mean",
    "staleness_max": "epoch_staleness_max",
}


def airflow_run_url(dag_id: str, airflow_run_id: str) -> str:
    """The Airflow UI's page of a DAG run (its grid and task logs), under the deployment's
    ``[api] base_url``; called from a DAG's task, where Airflow's configuration is at hand."""
    from airflow.configuration import conf

    base_url = conf.get("api", "base_url", fallback="http://localhost:8080")
    return f"{base_url.rstrip('/')}/dags/{quote(dag_id, safe='')}/runs/{quote(airflow_run_id, safe='')}"


def open_run(
    paths: RunPaths, spec: RunSpec, dag_id: str, airflow_run_id: str, airflow_url: str | None = None
) -> str | None:
    """The DAG run's MLflow run, created RUNNING (or found again on a retry) with the spec as params
    and tags naming the Airflow run; recorded in ``tracking.json`` for the later stages. Returns
    where a person opens it (``store.run_page``); None, with a warning, where MLflow does not answer.
    ``strategy=auto`` decides its spec when it provisions, after this run opens, and MLflow keeps a
    param's first value: its params wait for register (the decided spec, and ``requested_strategy``)."""
    started = time.time()
    params = {} if spec.cluster.strategy == "auto" else spec.flat()
    return open_named_run(paths, run_name(spec, started), params, dag_id, airflow_run_id, airflow_url, started)


def open_named_run(
    paths: RunPaths,
    name: str,
    params: dict[str, Any],
    dag_id: str,
    airflow_run_id: str,
    airflow_url: str | None,
    started: float,
) -> str | None:
    """``open_run`` for any DAG's run (a tuning study's too): its name and params given."""
    uri = store.tracking_uri()
    try:
        _check_answers(uri)
        client = timing.TimedClient(store.client(uri))
        run_id = store.find_or_create_run(client, dag_id, airflow_run_id, name, started)
        tags = [RunTag("mlflow.source.type", "JOB"), RunTag("mlflow.source.name", f"Airflow DAG {dag_id}")]
        if airflow_url:
            tags.append(RunTag("airflow.url", airflow_url))
        client.log_batch(run_id, params=[Param(key, str(value)) for key, value in params.items()], tags=tags)
        client.update_run(run_id, status="RUNNING")
    except _UNREACHABLE as error:
        log.warning("MLflow at %s did not answer (%s): the run appears there when register logs it", uri, _line(error))
        return None
    page, live = store.run_page(uri, run_id), store.run_page(uri, run_id, live=True)
    record = {"tracking_uri": uri, "mlflow_run_id": run_id, "dag_id": dag_id, "page": page, "live_page": live}
    write_record(paths.tracking, record)
    log.info("MLflow: %s (RUNNING)", page)
    if live != page:  # a tracking server's UI: where the curves show as they come
        log.info("MLflow, its charts while it trains: %s", live)
    return page


# How long the live calls wait for a tracking server before going on without it: MLflow's own
# retries (register's, which must not give up) took 247 s to fail against a closed port here.
REACHABLE_SECONDS = 5.0


def _check_answers(uri: str) -> None:
    """ConnectionError unless the tracking server at ``uri`` answers at all within REACHABLE_SECONDS
    (any HTTP reply, a 401 included); a local store always does."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        requests.get(f"{uri.rstrip('/')}/health", timeout=REACHABLE_SECONDS)
    except requests.exceptions.RequestException:
        raise requests.exceptions.ConnectionError(f"no answer within {REACHABLE_SECONDS:.0f} s") from None


def _line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def tracked_run(paths: RunPaths) -> tuple[MlflowClient, str] | None:
    """A client of the store and the MLflow run ``open_run`` recorded for this run directory, or None."""
    tracked = _tracked(paths)
    return None if tracked is None else (store.client(tracked["tracking_uri"]), tracked["mlflow_run_id"])


def tracked_page(paths: RunPaths) -> str | None:
    """Where a person opens the MLflow run ``open_run`` made for this run directory, or None."""
    return (_tracked(paths) or {}).get("page")


def _tracked(paths: RunPaths) -> dict | None:
    """What ``open_run`` recorded (the pipeline's own file, beside the spec), or None."""
    return json.loads(paths.tracking.read_text()) if paths.tracking.exists() else None


def usage_metric(replica: str, figure: str) -> str:
    """A replica's usage as an MLflow system metric: under ``system/``, at one level (MLflow's UI
    makes a section of everything before a key's last ``/``, and only ``system/<name>`` lands in its
    System metrics), the figure first so that one figure's charts of all replicas sit side by side:
    ``system/cpu_percent_worker-0``."""
    return f"system/{figure}_{replica}"


WAITING_SAMPLES = 200  # a minute of samples of a few replicas (one every 2 s)


class LiveRun:
    """A watcher (``hetflow.pipeline.progress.ProgressWatch``) logging each new epoch (step = epoch)
    and each usage sample (step = seconds since training began; MLflow charts system metrics against
    time) to the run, in batches."""

    __name__ = "the live MLflow run"

    def __init__(self, client: MlflowClient, run_id: str):
        self.client, self.run_id = client, run_id
        # A retried train logs no second point for an epoch the first try logged.
        self.logged = {metric.step for metric in client.get_metric_history(run_id, "val_accuracy")}
        self.started = time.monotonic()
        # Usage sampled before the first epoch, logged after it so that the curves come first; past
        # WAITING_SAMPLES (a minute without an epoch: a slow start, a hang) it is logged as it comes.
        self.waiting: list[Metric] = []

    def __call__(self, epochs: list[Epoch], usage: dict[str, dict[str, float]]) -> None:
        now = int(time.time() * 1000)  # the pipeline's clock: a replica's stays out of the run
        metrics = []
        for epoch in epochs:
            if epoch.epoch in self.logged:
                continue
            self.logged.add(epoch.epoch)
            metrics += [
                Metric(EPOCH_METRICS[name], as_computed(epoch.figures[name]), now, epoch.epoch)
                for name in EPOCH_METRICS
                if name in epoch.figures
            ]
            metrics += [
                Metric(f"epoch_examples_per_second/{worker}", as_computed(rate), now, epoch.epoch)
                for worker, rate in epoch.worker_examples_per_second.items()
            ]
        # From 1: MLflow's UI draws a metric seen only at step 0 as a bar, and reads no more of it.
        step = max(1, round(time.monotonic() - self.started))
        for replica, figures in usage.items():
            self.waiting += [Metric(usage_metric(replica, name), value, now, step) for name, value in figures.items()]
        if self.logged or len(self.waiting) > WAITING_SAMPLES:
            metrics, self.waiting = metrics + self.waiting, []
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])


def live_run(paths: RunPaths) -> LiveRun | None:
    """The run ``open_run`` made, RUNNING again (a retry after a failure), to log into; None where
    there is none (``hetflow train`` outside a DAG) or MLflow does not answer (a warning)."""
    tracked = _tracked(paths)
    if tracked is None:
        return None
    try:
        _check_answers(tracked["tracking_uri"])
        client = store.client(tracked["tracking_uri"])
        client.update_run(tracked["mlflow_run_id"], status="RUNNING")
        return LiveRun(client, tracked["mlflow_run_id"])
    except _UNREACHABLE as error:
        log.warning("MLflow did not answer (%s): training's curves appear when register logs them", _line(error))
        return None


def mark_failed(run_dir: Path, stage: str, reason: str) -> None:
    """End the run FAILED, naming the stage and its one-line reason; its curves so far stay. A run
    already FAILED keeps the stage that failed it first (summarize fails after it, saying so)."""
    tracked = _tracked(RunPaths(run_dir))
    if tracked is None:
        return
    try:
        _check_answers(tracked["tracking_uri"])
        client = timing.TimedClient(store.client(tracked["tracking_uri"]))
        run_id = tracked["mlflow_run_id"]
        if client.get_run(run_id).info.status == "FAILED":
            return
        client.log_batch(run_id, tags=[RunTag("failed_task", stage), RunTag("failure_reason", reason[:5000])])
        client.set_terminated(run_id, "FAILED")
    except _UNREACHABLE as error:
        log.warning("MLflow did not answer (%s): its run is not marked FAILED", _line(error))

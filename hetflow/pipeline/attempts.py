"""A stage's attempt: the records it owns in the run directory, the receipt it leaves, its timing.

Every DAG task but ``teardown_cluster`` and ``summarize`` is a stage: a plain function of the
Airflow run id (no Airflow import) that reads what earlier stages wrote in the run directory and
writes its own record there, so any stage can be re-run (an Airflow retry, a Clear) or run outside
Airflow (``hetflow train``, tests). Each attempt of a stage first removes its own record and every
later stage's, and when it succeeds leaves a receipt naming itself (``attempts/<stage>.json``):
``summarize`` trusts a record only with the receipt of the attempt Airflow reports as the stage's
last, successful try.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import time
import uuid
from typing import Any, Callable

from hetflow.paths import RunPaths, write_record
from hetflow.pipeline import timing
from hetflow.pipeline.progress import StoppedEarly
from hetflow.pipeline.task_log import failure_headline
from hetflow.spec import RunSpec

log = logging.getLogger("hetflow.stages")

# (stage, the record it writes), in DAG order; the stages' names are their Airflow task ids.
STAGE_OUTPUTS = (
    ("validate_spec", "spec"),
    ("prepare_data", "dataset"),
    ("provision_cluster", "cluster"),
    ("train", "training"),
    ("evaluate", "evaluation"),
    ("compress", "compression"),
    ("export", "export"),
    ("register", "registry"),
)
STAGES = tuple(stage for stage, _ in STAGE_OUTPUTS)


def reported(stage: Callable) -> Callable:
    """Time a DAG task (``hetflow.pipeline.timing``: its receipt records where its time went) and log its
    failure, with its reason, on the stages' logger: Airflow reports it in its own structured log,
    which `hetflow run`'s live view does not read. A failure also ends the run's MLflow run FAILED,
    with the stage and the reason (``hetflow.registry.live``)."""
    signature = inspect.signature(stage)

    @functools.wraps(stage)
    def run(*args, **kwargs):
        with timing.stage_clock():
            try:
                return stage(*args, **kwargs)
            except StoppedEarly as stopped:  # what a tuning study asked for: its trial records it
                log.info("%s: %s", stage.__name__, stopped)
                raise
            except Exception as error:
                headline = failure_headline(stage.__name__, error)
                log.error("%s", headline)
                _mark_failed(signature.bind(*args, **kwargs).arguments["run_id"], stage.__name__, headline)
                raise

    return run


def _mark_failed(run_id: str, stage: str, headline: str) -> None:
    from hetflow.paths import RunDirectoryTaken, run_paths
    from hetflow.registry.live import mark_failed

    try:
        paths = run_paths(run_id)
    except RunDirectoryTaken:  # refused at the start: the directory is another run's
        return
    mark_failed(paths.root, stage, headline)


def read_record(path) -> Any:
    return json.loads(path.read_text())


def load_spec(paths: RunPaths) -> RunSpec:
    return RunSpec.from_json(paths.spec.read_text())


@contextlib.contextmanager
def attempt(paths: RunPaths, stage: str, run_id: str, try_number: int | None):
    """One attempt of ``stage``: on entry it removes the records of this stage and of every later one,
    and the summary, so that no earlier attempt's files outlive a failing one; on success it writes
    the receipt naming this attempt (the dict it yields, which the stage also returns to Airflow) and
    saying where the stage's time went (``timing``: its start, unix time, and ``hetflow.pipeline.timing``'
    parts in seconds, up to the receipt).

    :param try_number: Airflow's try number of the task (None outside Airflow), for the reader.
    """
    for later, record in STAGE_OUTPUTS[STAGES.index(stage) :]:
        paths.attempt(later).unlink(missing_ok=True)  # the receipt first: a record without one is not trusted
        getattr(paths, record).unlink(missing_ok=True)
    paths.summary.unlink(missing_ok=True)
    receipt = {"stage": stage, "run_id": run_id, "try_number": try_number, "id": uuid.uuid4().hex}
    yield receipt
    clock = timing.current()
    spent = {"started_at": clock.started_at, **clock.record()} if clock else None
    write_record(
        paths.attempt(stage), {**receipt, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "timing": spent}
    )

"""The MLflow run of a hetflow DAG run, where a person looks for it in Airflow: on the DAG run's own
page, as its note, and as an "MLflow run" button on every task of the run.

The address is ``mlflow_run_url`` in what the run's first task returned when it opened the MLflow run
(hetflow.registry.live): read, never built from what a user typed, and shown only when it is a web
address.

- The note: Airflow 3.3 shows a DAG run's note at the top of the run's page (its first line, as
  Markdown), and a task cannot write one (its execution API has no call for it). The task's return
  value reaches the api-server as an XCom push, so this middleware, once Airflow has stored that push,
  writes the note: a link to the MLflow run. A note a person wrote is left as it is.
- The button: Airflow shows a task's extra links on its page; a link on hetflow's own tasks would
  need an operator class of our own, so this one is global and answers only for hetflow's DAGs (for
  any other task it answers nothing, and Airflow shows no button).
"""

from __future__ import annotations

import json
import logging

from airflow.models.dagrun import DagRun
from airflow.models.xcom import XCOM_RETURN_KEY, XComModel
from airflow.plugins_manager import AirflowPlugin
from airflow.sdk import BaseOperatorLink
from airflow.utils.session import create_session
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

log = logging.getLogger(__name__)

# The task of each hetflow DAG that opens the run's MLflow run (and returns its page's address), and
# what the note's link says.
OPENED_BY = {"hetflow_train": "validate_spec", "hetflow_tune": "validate_study"}
NOTE_TEXT = {"hetflow_train": "Open this run in MLflow", "hetflow_tune": "Open this study in MLflow"}


def opened_run_url(session, dag_id: str, run_id: str) -> str:
    """The MLflow run's page that the DAG run's opener returned; "" when it has not (yet)."""
    opener = OPENED_BY.get(dag_id)
    if opener is None:
        return ""
    pushed = session.execute(
        XComModel.get_many(key=XCOM_RETURN_KEY, run_id=run_id, dag_ids=dag_id, task_ids=opener).with_only_columns(
            XComModel.value
        )
    ).first()
    if pushed is None:
        return ""
    record = json.loads(pushed.value) if isinstance(pushed.value, str) else pushed.value
    url = record.get("mlflow_run_url") if isinstance(record, dict) else None
    return url if isinstance(url, str) and url.startswith(("http://", "https://")) else ""


def note_text(dag_id: str, url: str) -> str:
    return f"[{NOTE_TEXT[dag_id]} ↗]({url})"


def note_mlflow_run(dag_id: str, run_id: str) -> None:
    """Write the DAG run's note, a link to its MLflow run, unless a person wrote one."""
    with create_session() as session:
        url = opened_run_url(session, dag_id, run_id)
        dag_run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
        if not url or dag_run is None:
            return
        ours = not dag_run.note or dag_run.note.startswith(f"[{NOTE_TEXT[dag_id]} ")
        if ours and dag_run.note != note_text(dag_id, url):
            dag_run.note = note_text(dag_id, url)


class MLflowRunLink(BaseOperatorLink):
    name = "MLflow run"

    def get_link(self, operator, *, ti_key) -> str:
        with create_session() as session:
            return opened_run_url(session, ti_key.dag_id, ti_key.run_id)


class NoteOnOpen:
    """Pure ASGI: passes every request on; after Airflow has stored the return value of a hetflow
    DAG's opener (``POST /execution/xcoms/<dag>/<run>/<opener>/return_value``), writes the run's note."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        pushed = _opener_push(scope)
        if pushed is None:
            await self.app(scope, receive, send)
            return
        stored = False

        async def watched(message):
            nonlocal stored
            if message["type"] == "http.response.start":
                stored = message["status"] == 201
            await send(message)

        await self.app(scope, receive, watched)
        if stored:
            try:
                await run_in_threadpool(note_mlflow_run, *pushed)
            except Exception:  # the note is a convenience: the push itself has succeeded
                log.warning("could not write the MLflow run's note on %s %s", *pushed, exc_info=True)


def _opener_push(scope) -> tuple[str, str] | None:
    """(dag id, run id) of a request that pushes a hetflow opener's return value; None for any other."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    parts = scope["path"].split("/")
    if len(parts) != 7 or parts[:3] != ["", "execution", "xcoms"] or parts[6] != XCOM_RETURN_KEY:
        return None
    dag_id, run_id, task_id = parts[3:6]
    return (dag_id, run_id) if OPENED_BY.get(dag_id) == task_id else None


class HetflowMLflowLinkPlugin(AirflowPlugin):
    name = "hetflow_mlflow_link"
    global_operator_extra_links = [MLflowRunLink()]
    fastapi_root_middlewares = [{"name": "hetflow_mlflow_run_note", "middleware": NoteOnOpen}]

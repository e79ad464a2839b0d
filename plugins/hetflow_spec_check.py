"""Reject an invalid ``hetflow_train`` conf at trigger time with hetflow's own messages.

Airflow checks a triggered run's conf against each Param's JSON schema on its own, but accepts
unknown keys and cannot check keys against each other (``workers=2`` with ``strategy=one_device``);
those would fail only later, in the ``validate_spec`` task. This api-server middleware runs
``hetflow.spec.parse_spec`` on the conf of ``POST /api/v2/dags/hetflow_train/dagRuns`` — the request
the UI's trigger form sends too — and asks TFDS whether it knows the dataset's name, and answers
HTTP 400 with one line per problem, the same lines ``hetflow validate`` prints, before any run is
created. What needs the run's files or the network (a folder's images, whether a dataset can be
downloaded, a backend's preflight) is validate_spec's, the run's first task. A valid conf goes on
with the numbers the form sends as text (it types every number field as text) as the numbers they
spell, so the run's conf records ``"workers": 2``.
"""

from __future__ import annotations

import json

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
from airflow.configuration import conf
from airflow.plugins_manager import AirflowPlugin
from jwt import InvalidTokenError
from starlette.requests import Request
from starlette.responses import JSONResponse

from hetflow.data.prepare import name_problems
from hetflow.spec import SpecError, parse_spec
from hetflow.spec.form import numbers_as_numbers

TRIGGER_PATHS = {"/api/v2/dags/hetflow_train/dagRuns"}
DAG_ID = "hetflow_train"


def conf_problems(body: bytes) -> list[str]:
    """The spec problems of a trigger request's conf; [] when it is valid or not JSON (Airflow
    answers malformed requests itself)."""
    try:
        values = json.loads(body or b"{}").get("conf") or {}
    except (ValueError, AttributeError):
        return []
    if not isinstance(values, dict):
        return []
    try:
        spec = parse_spec(values)
    except SpecError as error:
        return [f"invalid spec: {problem}" for problem in error.problems]
    return [f"invalid spec: {problem}" for problem in name_problems(spec.data.dataset)]


def with_numbers_as_numbers(body: bytes) -> bytes:
    """A valid trigger request's body with the conf's numbers typed as text (the form's) recorded as
    the numbers they spell (``hetflow.spec.form.numbers_as_numbers``)."""
    try:
        request = json.loads(body or b"{}")
    except ValueError:  # Airflow answers it itself
        return body
    conf = request.get("conf") if isinstance(request, dict) else None
    if not isinstance(conf, dict):
        return body
    converted = numbers_as_numbers(conf)
    return body if converted == conf else json.dumps({**request, "conf": converted}).encode()


def _without_length(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value in headers if name.lower() != b"content-length"]


class SpecCheckMiddleware:
    """Pure ASGI: reads the request body once, and replays it to Airflow when the conf is valid."""

    def __init__(self, app):
        self.app = app
        # Without login everyone may trigger; with it, a caller must be known and allowed to trigger
        # before its body is read, and any other gets Airflow's own 401 or 403: hetflow's messages
        # name paths.
        self.open_access = conf.getboolean("core", "simple_auth_manager_all_admins", fallback=False)

    async def _may_trigger(self, scope) -> bool:
        """Whether login is off, or the request carries a token Airflow's auth manager accepts (a
        bearer header, else the UI's cookie: the precedence of Airflow's own get_user) of a user it
        lets trigger the DAG (the check Airflow's trigger endpoint makes)."""
        if self.open_access:
            return True
        request = Request(scope)
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        token = credentials if scheme.lower() == "bearer" else request.cookies.get(COOKIE_NAME_JWT_TOKEN)
        if not token:
            return False
        auth_manager = get_auth_manager()
        try:
            user = await auth_manager.get_user_from_token(token)
        except InvalidTokenError:  # forged or expired: Airflow refuses it itself
            return False
        return auth_manager.is_authorized_dag(
            method="POST", access_entity=DagAccessEntity.RUN, details=DagDetails(id=DAG_ID), user=user
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in TRIGGER_PATHS:
            await self.app(scope, receive, send)
            return
        if not await self._may_trigger(scope):
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        problems = conf_problems(body)
        if problems:
            await JSONResponse({"detail": "\n".join(problems)}, status_code=400)(scope, receive, send)
            return
        body = with_numbers_as_numbers(body)
        scope = {**scope, "headers": [*_without_length(scope["headers"]), (b"content-length", str(len(body)).encode())]}

        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class HetflowSpecCheck(AirflowPlugin):
    name = "hetflow_spec_check"
    fastapi_root_middlewares = [{"name": "hetflow_spec_check", "middleware": SpecCheckMiddleware}]

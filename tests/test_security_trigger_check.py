"""The trigger check (plugins/hetflow_spec_check.py) in front of Airflow's API, attacked by callers
who are not logged in: it reads no body of theirs, and answers them nothing of its own (hetflow's
messages name the machine's paths); Airflow answers them. A logged-in caller gets hetflow's lines."""

from __future__ import annotations

import asyncio
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "plugins"))

TRIGGER = "/api/v2/dags/hetflow_train/dagRuns"
CONF = {"logical_date": None, "conf": {"data_dir": "/etc/secret-place"}}


def _post(middleware, headers: list[tuple[bytes, bytes]]) -> tuple[int, str, bool]:
    """POST CONF to the trigger path through ``middleware``: the status, the body answered, and
    whether the middleware itself read the request's body."""
    read_by = []
    answer = {}

    async def receive():
        read_by.append("middleware" if not answer.get("airflow") else "airflow")
        return {"type": "http.request", "body": json.dumps(CONF).encode(), "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        else:
            answer["body"] = answer.get("body", "") + message.get("body", b"").decode()

    scope = {"type": "http", "method": "POST", "path": TRIGGER, "headers": headers, "query_string": b""}
    # A loop of its own, in a thread of its own: the UI tests' Playwright (session-scoped) keeps an
    # event loop running in this thread, where asyncio.run refuses to start another.
    with ThreadPoolExecutor(1) as thread:
        thread.submit(asyncio.run, middleware(scope, receive, send)).result()
    return answer["status"], answer["body"], "middleware" in read_by


async def _airflow(scope, receive, send):
    """Stands for Airflow's API behind the middleware: it refuses an unknown caller without the body."""
    await send({"type": "http.response.start", "status": 401, "headers": []})
    await send({"type": "http.response.body", "body": b'{"detail":"Not authenticated"}'})


@pytest.fixture
def middleware(hetflow_env, monkeypatch):
    from airflow.api_fastapi.app import init_auth_manager

    from hetflow.cli.dag_run import ensure_airflow_db

    ensure_airflow_db()  # a token is checked against the revoked ones
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "False")
    init_auth_manager()
    from hetflow_spec_check import SpecCheckMiddleware

    return SpecCheckMiddleware(_airflow)


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"authorization", b"Bearer forged")],
        [(b"authorization", b"Basic YWRtaW46YWRtaW4=")],
        [(b"cookie", b"_token=forged")],
    ],
    ids=["anonymous", "forged bearer", "basic", "forged cookie"],
)
def test_a_caller_not_logged_in_gets_airflows_answer_and_no_path(middleware, headers):
    status, body, body_read = _post(middleware, headers)
    assert (status, body_read) == (401, False)
    assert "/etc" not in body and "data_dir" not in body


def test_a_logged_in_caller_gets_hetflows_lines(middleware):
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    token = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
    status, body, body_read = _post(middleware, [(b"authorization", f"Bearer {token}".encode())])
    assert (status, body_read) == (400, True)
    assert json.loads(body)["detail"].startswith("invalid spec: data_dir=/etc/secret-place is invalid")


def test_a_logged_in_caller_who_may_not_trigger_gets_airflows_answer_and_no_path(middleware):
    """A viewer is logged in but may not trigger the DAG: its body is not read either."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    token = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="reader", role="viewer"))
    status, body, body_read = _post(middleware, [(b"authorization", f"Bearer {token}".encode())])
    assert (status, body_read) == (401, False)  # what the stand-in for Airflow answers
    assert "/etc" not in body and "data_dir" not in body


def test_a_dataset_name_tfds_does_not_know_is_refused_at_trigger_with_the_closest_name():
    from hetflow_spec_check import conf_problems

    def problems(dataset: str) -> list[str]:
        return conf_problems(json.dumps({"conf": {"dataset": dataset}}).encode())

    assert problems("mnistt") == [
        "invalid spec: dataset='mnistt' is not a TFDS dataset (did you mean mnist?); "
        "offline datasets: uci_digits, synthetic_cifar"
    ]
    # Known names pass, with a version or a config; a folder's images are validate_spec's to read.
    assert problems("mnist") == problems("mnist:3.0.1") == problems("uci_digits") == []
    assert problems("cifar10_corrupted/fog_1") == []

"""The trigger form's number fields as the api-server receives them: Airflow's form sends what was
typed in a number field as text ("2"); the trigger check (plugins/hetflow_spec_check.py) refuses bad
text as typed, with the spec's line, and hands Airflow the numbers good text spells, so the run's
conf records numbers."""

from __future__ import annotations

import asyncio
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "plugins"))

TRIGGER = "/api/v2/dags/hetflow_train/dagRuns"


def _trigger(middleware, conf: dict) -> tuple[int, dict, dict | None]:
    """POST ``conf`` to the trigger path through ``middleware``: the status, the answer, and the
    request Airflow received (its body parsed, its content-length), None where it received none."""
    body = json.dumps({"logical_date": None, "conf": conf}).encode()
    answer: dict = {"body": b""}
    received: dict = {}

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        else:
            answer["body"] += message.get("body", b"")

    async def airflow(scope, airflow_receive, airflow_send):
        message = await airflow_receive()
        received["body"] = json.loads(message["body"])
        received["length"] = int(dict(scope["headers"])[b"content-length"])
        received["bytes"] = len(message["body"])
        await airflow_send({"type": "http.response.start", "status": 200, "headers": []})
        await airflow_send({"type": "http.response.body", "body": b"{}"})

    scope = {"type": "http", "method": "POST", "path": TRIGGER, "headers": [(b"content-length", b"1")]}
    # A loop of its own in a thread of its own: the UI tests' Playwright keeps one running here.
    with ThreadPoolExecutor(1) as thread:
        thread.submit(asyncio.run, middleware(airflow)(scope, receive, send)).result()
    return answer["status"], json.loads(answer["body"]), received or None


@pytest.fixture
def middleware(hetflow_env, monkeypatch):
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "True")  # no login: no token needed
    from hetflow_spec_check import SpecCheckMiddleware

    return SpecCheckMiddleware


def test_numbers_typed_as_text_reach_the_run_as_numbers(middleware):
    typed = {"strategy": "multi_worker_mirrored", "workers": "2", "epochs": "3", "learning_rate": "0.010"}
    status, _, received = _trigger(middleware, {**typed, "model": "mlp", "steps_per_epoch": None})
    assert status == 200 and received is not None
    assert received["body"]["conf"] == {
        "strategy": "multi_worker_mirrored",
        "workers": 2,
        "epochs": 3,
        "learning_rate": 0.01,
        "model": "mlp",
        "steps_per_epoch": None,
    }
    assert received["length"] == received["bytes"]
    # A REST caller's numbers, and a conf with nothing typed as text, go on as they came.
    status, _, received = _trigger(middleware, {"epochs": 3, "dataset": "uci_digits"})
    assert status == 200 and received["body"]["conf"] == {"epochs": 3, "dataset": "uci_digits"}


@pytest.mark.parametrize(
    "typed, line",
    [
        ({"epochs": "-1"}, 'epochs="-1" is invalid: expected an integer >= 1 and <= 1000'),
        ({"workers": "2.5"}, 'workers="2.5" is invalid: expected an integer >= 1 and <= 16'),
        ({"epochs": "ten"}, 'epochs="ten" is invalid: expected an integer >= 1 and <= 1000'),
    ],
    ids=["out of range", "not an integer", "not a number"],
)
def test_a_bad_number_is_refused_as_typed_and_airflow_gets_nothing(middleware, typed, line):
    status, answer, received = _trigger(middleware, typed)
    assert (status, received) == (400, None)
    assert answer["detail"].splitlines() == [f"invalid spec: {line}"], answer

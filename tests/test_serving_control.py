"""The endpoint's control socket (hetflow/serving/control.py) on a real Unix socket: what it accepts,
what it refuses in one line, who may connect, and how it takes over a socket left by a dead endpoint.
The deploy DAG's side, against a live endpoint, is tests/test_dags_deploy.py."""

from __future__ import annotations

import json
import socket
import stat

import pytest

from hetflow.serving import control
from hetflow.tasks.deploy import targets


@pytest.fixture()
def server(tmp_path):
    asked = []

    def answer(model: str, version: str) -> dict:
        asked.append((model, version))
        return {"state": "pending"}

    served = control.ControlServer(control.socket_path(tmp_path), answer)
    served.start()
    yield served, asked
    served.stop()


def _send(path, raw: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(str(path))
        connection.sendall(raw)
        connection.shutdown(socket.SHUT_WR)  # all sent: a line without its end stays without it
        return json.loads(connection.makefile("rb").readline())


def test_a_request_names_a_model_and_a_version_and_anything_else_is_refused_in_one_line(server):
    served, asked = server
    assert control.ask("digits", "3", served.path) == {"state": "pending"}
    assert _send(served.path, b'{"model": "digits", "version": 4}\n') == {"state": "pending"}
    assert asked == [("digits", "3"), ("digits", "4")]
    refused = {
        b"rm -rf /\n": "not JSON: Expecting value: line 1 column 1 (char 0)",
        b'["digits", 3]\n': "a request is a JSON object with model and version, not list",
        b'{"model": "digits", "version": "3", "path": "/etc"}\n': "path: not a field; allowed: model, version",
        b'{"model": "digits", "version": "0"}\n': "version '0': a model version's number, 1 or more (e.g. 3 or \"3\")",
        b'{"model": "", "version": "3"}\n': "model '': a registered model's name, 1 to 256 printable characters",
        b'{"model": "digits"}': "a request is one JSON line of at most 4096 bytes",  # no end of line
        b'{"model": "' + b"d" * 5000 + b'"}\n': "a request is one JSON line of at most 4096 bytes",
    }
    for raw, reason in refused.items():
        assert _send(served.path, raw) == {"state": "bad request", "reason": reason}, raw[:60]
    assert len(asked) == 2, "nothing refused reached the endpoint"


def test_only_its_user_may_connect_and_a_dead_endpoints_socket_is_taken_over(server, tmp_path):
    served, _ = server
    assert stat.S_IMODE(served.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(served.path.parent.stat().st_mode) == 0o700
    second = control.ControlServer(served.path, lambda model, version: {})
    with pytest.raises(control.SocketTaken, match="another endpoint answers the deploy DAG on "):
        second.start()
    served.stop()
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # bound and closed: what a killed endpoint leaves
    left.bind(str(served.path))
    left.close()
    with pytest.raises(control.NoEndpoint, match=r"no hetflow endpoint is running .* start one with `make serve`"):
        control.ask("digits", "3", served.path)
    second.start()
    try:
        assert control.ask("digits", "3", served.path) == {}
    finally:
        second.stop()
    served.path.write_text("planted")
    with pytest.raises(control.SocketTaken, match="exists and is not a socket: refused"):
        control.ControlServer(served.path, lambda model, version: {}).start()


def test_what_a_deploy_run_deploys_comes_from_its_conf_or_else_its_champion_events():
    events = [{"model": "digits", "version": "4"}, {"model": "digits-tflite", "version": "2"}]
    assert targets({"model": "digits", "version": 3}, events) == [("digits", "3")]
    assert targets({}, [*events, events[0]]) == [("digits", "4"), ("digits-tflite", "2")]
    with pytest.raises(control.BadRequest, match=r'^nothing to deploy: trigger with conf \{"model": NAME'):
        targets({}, [])
    with pytest.raises(control.BadRequest, match=r"^modle: not a field; allowed: model, version$"):
        targets({"modle": "digits", "version": "3"}, [])

"""The edge origin behind a real HAProxy (balancer.Balancer) on a real MLflow store holding two TFLite
versions registered as register does it (test_serving_edge's registry): what a device polling
127.0.0.1 gets for the champion, its manifest and its file, and that it follows the alias."""

from __future__ import annotations

import hashlib
import http.client
import json
from pathlib import Path

import pytest
from conftest import wait_for
from test_serving_edge import NAME, registry  # noqa: F401 - the same two TFLite versions, fixture of this module

from hetflow.serving.server import free_port

pytestmark = pytest.mark.skipif(not Path("/usr/sbin/haproxy").exists(), reason="Debian's haproxy: make sandbox")

TOKEN = "edge-origin-test-token-0123"


def _get(port, path, headers=None, method="GET"):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, headers={"Authorization": f"Bearer {TOKEN}", **(headers or {})})
        response = connection.getresponse()
        return response.status, response.headers, response.read()  # HAProxy sends header names in lower case
    finally:
        connection.close()


def _version_served(port):
    status, _, body = _get(port, f"/v1/edge/{NAME}/manifest")
    return status == 200 and json.loads(body)["version"]


@pytest.fixture(scope="module")
def origin(registry, tmp_path_factory):  # noqa: F811
    """The origin following the registry, HAProxy in front (with a token, as a non-loopback endpoint
    would have), champion on version 1; a float model whose champion has no edge bundle beside it."""
    from hetflow.serving.balancer import Balancer
    from hetflow.serving.edge_origin import EdgeOrigin

    client, _, _ = registry
    client.create_registered_model("hetflow-digits")
    float_version = client.create_model_version("hetflow-digits", source=str(tmp_path_factory.mktemp("float")))
    client.set_registered_model_alias("hetflow-digits", "champion", float_version.version)
    client.set_registered_model_alias(NAME, "champion", "1")
    folder = tmp_path_factory.mktemp("endpoint")
    edge = EdgeOrigin(client, folder / "edge", poll_seconds=0.3).start()
    balancer = Balancer(folder / "balancer", port=free_port(), token=TOKEN, edge_socket=edge.socket_path)
    try:
        balancer.start()
        assert wait_for(lambda: _version_served(balancer.port) == 1, timeout=20)
        yield client, balancer.port, edge
    finally:
        balancer.stop()
        edge.stop()


def _registered_bytes(client, version, folder):
    """The version's file as MLflow stores it, read without the origin."""
    import mlflow

    source = client.get_model_version(NAME, version).source
    path = client.get_model_version(NAME, version).tags["edge.file"]
    return Path(mlflow.artifacts.download_artifacts(f"{source}/{path}", dst_path=str(folder))).read_bytes()


def test_the_manifest_names_the_champion_and_the_file_is_its_registered_bytes(origin, tmp_path):
    client, port, _ = origin
    client.set_registered_model_alias(NAME, "champion", "1")
    assert wait_for(lambda: _version_served(port) == 1, timeout=10)
    status, headers, body = _get(port, f"/v1/edge/{NAME}/manifest")
    manifest = json.loads(body)
    registered = _registered_bytes(client, "1", tmp_path)
    assert status == 200 and headers["Content-Type"] == "application/json" and headers["X-Model-Version"] == "1"
    assert (manifest["model"], manifest["version"], manifest["alias"]) == (NAME, 1, "champion")
    assert manifest["file"] == "pruned_int8.tflite" and manifest["url"] == f"/v1/edge/{NAME}/model.tflite"
    assert manifest["sha256"] == hashlib.sha256(registered).hexdigest()
    assert manifest["size_bytes"] == len(registered)
    assert manifest["latency_ms"] == {"1": {"p50_ms": 0.05, "p95_ms": 0.07}, "2": {"p50_ms": 0.04, "p95_ms": 0.06}}
    assert manifest["metadata"]["version"] == "1" and manifest["metadata"]["labels"] == list("0123456789")

    status, headers, data = _get(port, manifest["url"])
    assert status == 200 and data == registered
    assert headers["Content-Length"] == str(len(registered))
    assert headers["ETag"] == f'"{hashlib.sha256(data).hexdigest()}"'
    assert headers["Content-Type"] == "application/octet-stream" and headers["X-Model-Version"] == "1"
    # A device that holds this file is told so, without the bytes; another file's tag gets the file.
    status, headers, data = _get(port, manifest["url"], {"If-None-Match": f'"{"0" * 64}", {headers["ETag"]}'})
    assert (status, data, headers["ETag"]) == (304, b"", f'"{manifest["sha256"]}"')
    status, _, data = _get(port, manifest["url"], {"If-None-Match": f'"{"0" * 64}"'})
    assert status == 200 and data == registered
    status, headers, data = _get(port, manifest["url"], method="HEAD")
    assert status == 200 and data == b"" and headers["Content-Length"] == str(len(registered))


def test_the_manifest_follows_a_moved_alias_only_once_its_file_is_there(origin, tmp_path):
    client, port, edge = origin
    client.set_registered_model_alias(NAME, "champion", "1")
    assert wait_for(lambda: _version_served(port) == 1, timeout=10)
    client.set_registered_model_alias(NAME, "champion", "2")
    assert wait_for(lambda: _version_served(port) == 2, timeout=10)
    _, headers, data = _get(port, f"/v1/edge/{NAME}/model.tflite")
    assert data == _registered_bytes(client, "2", tmp_path) and headers["X-Model-Version"] == "2"
    assert headers["ETag"] == f'"{client.get_model_version(NAME, "2").tags["edge.sha256"]}"'
    # A device holding version 1's file now gets version 2's.
    status, _, _ = _get(
        port, f"/v1/edge/{NAME}/model.tflite", {"If-None-Match": f'"{hashlib.sha256(b"").hexdigest()}"'}
    )
    assert status == 200
    # Only the champion's checked copy is kept.
    assert [path.name for path in (edge.files).iterdir()] == [f"{NAME}-v2.tflite"]


def test_a_champion_whose_file_is_not_the_registered_one_is_never_announced(origin):
    client, port, _ = origin
    client.set_registered_model_alias(NAME, "champion", "2")
    assert wait_for(lambda: _version_served(port) == 2, timeout=10)
    kept = client.get_model_version(NAME, "1").tags["edge.sha256"]
    try:
        client.set_model_version_tag(NAME, "1", "edge.sha256", "0" * 64)
        client.set_registered_model_alias(NAME, "champion", "1")
        assert wait_for(lambda: _get(port, f"/v1/edge/{NAME}/manifest")[0] == 404, timeout=10)
        status, _, body = _get(port, f"/v1/edge/{NAME}/model.tflite")
        assert status == 404 and body.count(b"\n") == 1
        assert "its manifest says 0000" in json.loads(body)["error"]
    finally:
        client.set_model_version_tag(NAME, "1", "edge.sha256", kept)


def test_a_model_without_a_tflite_champion_and_a_bad_name_get_one_line(origin):
    _, port, _ = origin
    status, _, body = _get(port, "/v1/edge/hetflow-digits/manifest")
    assert status == 404 and body.count(b"\n") == 1
    assert json.loads(body)["error"].startswith(
        "no TFLite champion for 'hetflow-digits': hetflow-digits version 1 has no edge bundle"
    )
    status, _, body = _get(port, "/v1/edge/no-such-model/model.tflite")
    assert (status, json.loads(body)) == (
        404,
        {"error": "no TFLite champion for 'no-such-model': model 'no-such-model' has no champion"},
    )
    for path in ("/v1/edge/../manifest", "/v1/edge/..%2F..%2Fetc%2Fpasswd/model.tflite", "/v1/edge/.hidden/manifest"):
        status, _, body = _get(port, path)
        assert status == 400 and body.count(b"\n") == 1, path
        assert json.loads(body)["error"].startswith("model: ") and "is not a registered model's name" in body.decode()
    status, _, body = _get(port, f"/v1/edge/{NAME}/../../haproxy.cfg")
    assert (status, json.loads(body)["error"]) == (
        404,
        "no such path: use /v1/edge/<model>/manifest or /v1/edge/<model>/model.tflite",
    )


def test_the_endpoint_s_token_and_body_limit_hold_for_the_edge(origin):
    _, port, _ = origin
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", f"/v1/edge/{NAME}/manifest")
        response = connection.getresponse()
        assert response.status == 401 and "Bearer" in json.loads(response.read())["error"]
    finally:
        connection.close()
    status, _, body = _get(port, f"/v1/edge/{NAME}/manifest", {"Content-Length": str(64 << 20)}, method="POST")
    assert status == 413 and body.count(b"\n") <= 1


def test_the_endpoint_answers_the_edge_on_its_port_and_leaves_no_socket(tmp_path):
    import threading

    from hetflow.serving.endpoint import Endpoint

    port = free_port()
    served = Endpoint(f"sqlite:///{tmp_path / 'empty.db'}", tmp_path / "e", port=port)
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=served.serve, args=(stop, ready))
    thread.start()
    try:
        assert ready.wait(60)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", f"/v1/edge/{NAME}/manifest")
        response = connection.getresponse()
        body = response.read()
        connection.close()
        assert response.status == 404 and body.count(b"\n") == 1
        assert json.loads(body)["error"] == f"no TFLite champion for {NAME!r}: model {NAME!r} has no champion"
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive() and not served.edge.socket_path.exists()

"""The model servers of a registered version: TF Serving's REST API and MLflow's /invocations from
sandboxed processes on Unix sockets, serving a checked copy of the version's files."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import wait_for

from hetflow.cluster.processes import group_members
from hetflow.serving.replicas import MANIFEST, CopyRefused, VersionServers
from hetflow.serving.server_process import ServingError, UnixHTTPConnection

FLOAT, TFLITE = "served-digits", "served-digits-tflite"
MAX_INSTANCES = 8
MAX_BODY_BYTES = 64 << 10
START_SECONDS = 120


@pytest.fixture(scope="module")
def registered(tmp_path_factory) -> dict:
    """A small Keras model registered in the two forms hetflow registers a run's model in
    (``hetflow.registry.versions``): MLflow's TensorFlow flavor holding a ``tf.Module`` whose
    SavedModel keeps the export's ``serving_default`` (uint8 ``image`` -> ``logits``), and a pyfunc
    holding a TFLite file as its ``tflite`` artifact; with the Keras model's own logits."""
    import tensorflow as tf
    from mlflow.models import infer_signature

    import mlflow
    from hetflow.artifacts.tflite import to_tflite
    from hetflow.models.architectures import build_model
    from hetflow.registry import store

    root = tmp_path_factory.mktemp("registry")
    images = np.random.default_rng(7).integers(0, 256, size=(12, 8, 8, 1), dtype=np.uint8)
    model = build_model("mlp", [8, 8, 1], 10, seed=3)
    logits = model.predict(images, verbose=0)
    spec = tf.TensorSpec([None, 8, 8, 1], tf.uint8, name="image")
    serve = tf.function(lambda image: {"logits": model(image, training=False)}).get_concrete_function(spec)
    module = tf.Module()
    module.model = model
    module.__call__ = tf.function(lambda image: model(image, training=False), input_signature=[spec])
    signature = infer_signature(images[:2], logits[:2])
    mlflow.tensorflow.save_model(
        module,
        str(root / FLOAT),
        saved_model_kwargs={"signatures": {"serving_default": serve}},
        signature=signature,
        input_example=images[:3],
    )
    (root / "model.tflite").write_bytes(to_tflite(model, "none"))
    mlflow.pyfunc.save_model(
        str(root / TFLITE),
        python_model=str(Path(store.__file__).with_name("tflite_pyfunc.py")),
        artifacts={"tflite": str(root / "model.tflite")},
        signature=signature,
        input_example=images[:3],
    )
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = store.client(uri)
    for name in (FLOAT, TFLITE):
        client.create_registered_model(name)
        client.create_model_version(name, source=(root / name).as_uri())
    return {"uri": uri, "images": images, "logits": logits}


def _servers(registered, name: str, run_dir: Path, replicas: int = 1) -> VersionServers:
    return VersionServers(
        f"models:/{name}/1",
        registered["uri"],
        run_dir,
        replicas=replicas,
        max_instances=MAX_INSTANCES,
        max_body_bytes=MAX_BODY_BYTES,
    )


@pytest.fixture(scope="module")
def float_servers(registered, tmp_path_factory):
    servers = _servers(registered, FLOAT, tmp_path_factory.mktemp("float"))
    try:
        servers.start(time.monotonic() + START_SECONDS)
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def tflite_servers(registered, tmp_path_factory):
    servers = _servers(registered, TFLITE, tmp_path_factory.mktemp("tflite"), replicas=2)
    try:
        servers.start(time.monotonic() + START_SECONDS)
        yield servers
    finally:
        servers.stop()


@pytest.fixture(params=[FLOAT, TFLITE])
def served(request, float_servers, tflite_servers) -> VersionServers:
    return float_servers if request.param == FLOAT else tflite_servers


def _answer(servers: VersionServers, method: str, path: str, body=None) -> tuple[int, dict, dict]:
    status, headers, raw = servers.request(method, path, body)
    assert headers["X-Model-Name"] == servers.name and headers["X-Model-Version"] == "1", headers
    text = raw.decode()
    assert "Traceback" not in text and text.count("\n") == 1 and text.endswith("\n"), text
    return status, headers, json.loads(text)


def test_the_row_and_columnar_forms_and_invocations_give_the_keras_models_logits(served, registered):
    images, logits = registered["images"][:MAX_INSTANCES], registered["logits"][:MAX_INSTANCES]
    name = served.name
    rows = {"instances": images.tolist()}
    for path in (f"/v1/models/{name}:predict", f"/v1/models/{name}/versions/1:predict"):
        status, _, answer = _answer(served, "POST", path, rows)
        assert status == 200 and set(answer) == {"predictions"}
        np.testing.assert_allclose(np.asarray(answer["predictions"]), logits, atol=1e-5)
    for label in ("stable", "canary"):  # which version a label names is the balancer's routing
        _, _, answer = _answer(served, "POST", f"/v1/models/{name}/labels/{label}:predict", rows)
        np.testing.assert_allclose(np.asarray(answer["predictions"]), logits, atol=1e-5)
    named_rows = {"signature_name": "serving_default", "instances": [{"image": image} for image in images.tolist()]}
    if served.name == FLOAT:  # the SavedModel's input is named; the TFLite file's name is the converter's
        _, _, answer = _answer(served, "POST", f"/v1/models/{name}:predict", named_rows)
        np.testing.assert_allclose(np.asarray(answer["predictions"]), logits, atol=1e-5)
    status, _, answer = _answer(served, "POST", f"/v1/models/{name}:predict", {"inputs": images[:3].tolist()})
    assert status == 200 and set(answer) == {"outputs"}
    np.testing.assert_allclose(np.asarray(answer["outputs"]), logits[:3], atol=1e-5)
    split = {"dataframe_split": {"columns": [str(i) for i in range(64)], "data": images.reshape(-1, 64).tolist()}}
    for body in (split, {"instances": images.tolist()}, {"inputs": images.tolist()}):
        status, _, answer = _answer(served, "POST", "/invocations", body)
        assert status == 200 and set(answer) == {"predictions"}
        np.testing.assert_allclose(np.asarray(answer["predictions"]), logits, atol=1e-5)
    np.testing.assert_allclose(served.predict(registered["images"]), registered["logits"], atol=1e-5)
    example = served.input_example()  # what MLflow recorded with the version, for warm-up
    assert example.dtype == np.uint8 and np.array_equal(example, registered["images"][:3])


def test_the_status_and_metadata_say_what_tf_serving_says(float_servers):
    available = {
        "model_version_status": [
            {"version": "1", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}
        ]
    }
    for path in (f"/v1/models/{FLOAT}", f"/v1/models/{FLOAT}/versions/1"):
        assert _answer(float_servers, "GET", path)[::2] == (200, available)
    status, _, metadata = _answer(float_servers, "GET", f"/v1/models/{FLOAT}/metadata")
    definition = metadata["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert status == 200 and metadata["model_spec"] == {"name": FLOAT, "signature_name": "", "version": "1"}
    assert definition["inputs"]["image"]["dtype"] == "DT_UINT8"
    assert [d["size"] for d in definition["inputs"]["image"]["tensor_shape"]["dim"]] == ["-1", "8", "8", "1"]
    assert [d["size"] for d in definition["outputs"]["logits"]["tensor_shape"]["dim"]] == ["-1", "10"]
    assert float_servers.request("GET", "/ping")[0] == 200


IMAGE = [[[0]] * 8] * 8


@pytest.mark.parametrize(
    "body, expected",
    [
        (
            {"instances": [[[1, 2]]]},
            "instances: shape [1, 1, 2], expected the model's input 'image' of shape [-1, 8, 8, 1]",
        ),
        ({"inputs": [IMAGE[0]]}, "inputs: shape [1, 8, 1], expected the model's input 'image' of shape [-1, 8, 8, 1]"),
        ({"instances": [IMAGE, IMAGE[:7]]}, "instances: not a rectangular array of numbers"),
        ({"instances": [[[["a"]] * 8] * 8]}, "instances: strings or objects where the model's input 'image'"),
        ({"instances": [[[[0.5]] * 8] * 8]}, "instances: numbers with a fraction where the model's input 'image'"),
        ({"instances": [[[[256]] * 8] * 8]}, "instances: values 256..256 out of uint8's range 0..255"),
        (
            {"instances": [IMAGE] * (MAX_INSTANCES + 1)},
            f"instances: 9 instances, over this server's limit of {MAX_INSTANCES}",
        ),
        ({"instances": []}, "instances: no values in the list"),
        ({"instances": [IMAGE], "inputs": [IMAGE]}, "expected exactly one of the keys 'instances' (rows) or 'inputs'"),
        ({"instances": [IMAGE], "signature_name": "classify"}, "signature_name: 'classify' is not one of"),
        (b"{not json", "the body is not JSON"),
        (b"[1, 2]", "the body must be a JSON object, got list"),
    ],
)
def test_bad_input_gets_a_400_of_one_line_naming_what_is_wrong(float_servers, body, expected):
    status, _, answer = _answer(float_servers, "POST", f"/v1/models/{FLOAT}:predict", body)
    assert status == 400 and list(answer) == ["error"] and answer["error"].startswith(expected[:20])
    assert expected in answer["error"], answer


def test_bad_input_to_invocations_and_a_tflite_server_is_refused_alike(tflite_servers):
    status, _, answer = _answer(tflite_servers, "POST", "/invocations", {"dataframe_split": {"data": [[1, 2]]}})
    assert status == 400 and "dataframe_split.data: shape [1, 2], expected" in answer["error"]
    status, _, answer = _answer(tflite_servers, "POST", "/invocations", {"records": []})
    assert status == 400 and answer["error"].startswith("expected exactly one of the keys dataframe_split")
    status, _, answer = _answer(tflite_servers, "POST", f"/v1/models/{TFLITE}:predict", {"instances": [[1]]})
    assert status == 400 and "of shape [-1, 8, 8, 1] (uint8)" in answer["error"]


def test_a_body_over_the_limit_is_413_and_unknown_paths_models_and_versions_404(float_servers):
    # Far more than a socket's buffers hold: the client is still sending when the refusal comes.
    oversized = 16 * MAX_BODY_BYTES
    status, _, answer = _answer(float_servers, "POST", f"/v1/models/{FLOAT}:predict", b" " * oversized)
    assert status == 413
    assert answer == {"error": f"the body is {oversized} bytes, over this server's limit of {MAX_BODY_BYTES}"}
    not_found = [
        ("GET", "/v2/health", "no such path: GET /v2/health"),
        ("POST", f"/v1/models/{FLOAT}/versions/2:predict", f"Servable not found for request: Specific({FLOAT}, 2)"),
        ("POST", "/v1/models/other:predict", "Servable not found for request: Latest(other)"),
        ("GET", f"/v1/models/{FLOAT}/versions/2", f"Could not find version 2 of model {FLOAT}"),
        ("GET", "/v1/models/other", "Could not find any versions of model other"),
    ]
    for method, path, error in not_found:
        assert _answer(float_servers, method, path, {"instances": [IMAGE]})[::2] == (404, {"error": error})


def _counts(servers: VersionServers) -> dict[str, float]:
    status, headers, raw = servers.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    labels = f'model="{servers.name}",version="1"'
    found = dict(re.findall(r"^(model_server_\S+) (\S+)$", raw.decode(), re.MULTILINE))
    return {
        key: float(found.get(metric.replace("LABELS", labels), 0))
        for key, metric in {
            "ok": 'model_server_requests_total{LABELS,api="predict",code="200"}',
            "bad": 'model_server_requests_total{LABELS,api="predict",code="400"}',
            "invocations": 'model_server_requests_total{LABELS,api="invocations",code="200"}',
            "errors": "model_server_request_errors_total{LABELS}",
            "count": "model_server_request_duration_seconds_count{LABELS}",
            "inf": 'model_server_request_duration_seconds_bucket{LABELS,le="+Inf"}',
        }.items()
    }


def test_metrics_count_the_prediction_requests_by_outcome(float_servers):
    before = _counts(float_servers)
    for _ in range(3):
        float_servers.request("POST", f"/v1/models/{FLOAT}:predict", {"instances": [IMAGE]})
    float_servers.request("POST", f"/v1/models/{FLOAT}:predict", {"instances": [[1]]})
    float_servers.request("POST", "/invocations", {"instances": [IMAGE]})
    float_servers.request("GET", "/ping")  # health checks are not counted
    after = _counts(float_servers)
    assert {key: after[key] - before[key] for key in after} == {
        "ok": 3,
        "bad": 1,
        "invocations": 1,
        "errors": 0,
        "count": 5,
        "inf": 5,
    }


def test_a_killed_replica_is_seen_dead_and_restarted_while_the_other_answers(tflite_servers, registered):
    images, logits = registered["images"], registered["logits"]
    os.kill(tflite_servers.server_pid(1), signal.SIGKILL)
    wait_for(lambda: tflite_servers.alive() == [True, False], timeout=15)
    assert tflite_servers.dead_replicas() == [1]
    np.testing.assert_allclose(tflite_servers.predict(images, replica=0), logits, atol=1e-5)
    with pytest.raises(ServingError):
        tflite_servers.predict(images, replica=1)
    tflite_servers.restart(1)
    assert tflite_servers.alive() == [True, True] and tflite_servers.dead_replicas() == []
    np.testing.assert_allclose(tflite_servers.predict(images, replica=1), logits, atol=1e-5)


def test_stop_leaves_no_process_and_a_start_past_its_deadline_leaves_none_either(registered, tmp_path):
    servers = _servers(registered, TFLITE, tmp_path / "v", replicas=2)
    servers.start(time.monotonic() + START_SECONDS)
    pgids = servers.pgids
    assert all(group_members(pgid) for pgid in pgids) and all(path.is_socket() for path in servers.sockets)
    # A request in flight as stop() begins (its headers sent, its body not yet) is still answered.
    body = json.dumps({"instances": registered["images"][:2].tolist()}).encode()
    in_flight = UnixHTTPConnection(servers.sockets[0], timeout=30)
    in_flight.putrequest("POST", f"/v1/models/{TFLITE}:predict")
    in_flight.putheader("Content-Length", str(len(body)))
    in_flight.endheaders()
    time.sleep(0.5)  # the server is reading the body
    stopping = threading.Thread(target=servers.stop)
    stopping.start()
    wait_for(lambda: not servers.server_pid(1), timeout=15)  # the other server, idle, has stopped
    in_flight.send(body)
    answer = in_flight.getresponse()
    assert answer.status == 200
    np.testing.assert_allclose(json.loads(answer.read())["predictions"], registered["logits"][:2], atol=1e-5)
    stopping.join(30)
    servers.stop()  # again: nothing left to end, and no error
    assert [group_members(pgid) for pgid in pgids] == [[], []]
    assert not any(path.exists() for path in servers.sockets)
    # Each server was asked to stop, and did, before its sandbox was ended.
    assert [servers.log_tail(i).splitlines()[-1].endswith("model_server: stopped") for i in range(2)] == [True, True]
    late = _servers(registered, TFLITE, tmp_path / "v")  # the staged copy re-used
    with pytest.raises(ServingError, match="replica 0: server not healthy by its deadline"):
        late.start(time.monotonic())
    assert late.pgids[0] is not None and group_members(late.pgids[0]) == []


def _refused_before_anything_starts(servers: VersionServers, match: str) -> None:
    with pytest.raises(CopyRefused, match=match):
        servers.start(time.monotonic() + START_SECONDS)
    assert servers.pgids == [None]


def test_a_copy_changed_after_its_check_is_refused_before_anything_loads_it(registered, tmp_path):
    staged = _servers(registered, TFLITE, tmp_path / "v")
    files = staged.stage()
    record = json.loads((tmp_path / "v" / MANIFEST).read_text())
    assert record["model_uri"] == f"models:/{TFLITE}/1" and record["files"] == files
    assert (
        "MLmodel" in files
        and files["artifacts/model.tflite"]["bytes"] == (staged.model_dir / "artifacts/model.tflite").stat().st_size
    )
    weights = staged.model_dir / "artifacts" / "model.tflite"
    assert not os.access(weights, os.W_OK) or os.geteuid() == 0  # read-only, but to root
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # the same size, one bit changed
    _refused_before_anything_starts(
        _servers(registered, TFLITE, tmp_path / "v"), r"changed since it was checked \(artifacts/model.tflite\)"
    )
    weights.write_bytes(original)
    (staged.model_dir / "artifacts" / "labels.txt").symlink_to("/etc/passwd")
    _refused_before_anything_starts(
        _servers(registered, TFLITE, tmp_path / "v"), "symlink, artifacts/labels.txt -> /etc/passwd"
    )
    (staged.model_dir / "artifacts" / "labels.txt").unlink()
    os.link(weights, tmp_path / "elsewhere")
    _refused_before_anything_starts(_servers(registered, TFLITE, tmp_path / "v"), "model.tflite has 2 hard links")


def test_a_copy_that_differs_from_the_registry_never_lands(registered, tmp_path):
    from hetflow.registry import store
    from hetflow.serving.replicas import check_copy, registry_listing

    location = store.client(registered["uri"]).get_model_version_download_uri(TFLITE, "1")
    listing = registry_listing(location, registered["uri"])
    assert "MLmodel" in listing and listing["artifacts/model.tflite"] > 0
    copy = tmp_path / "copy"
    copy.mkdir()
    for relative in listing:
        (copy / relative).parent.mkdir(parents=True, exist_ok=True)
        (copy / relative).write_bytes(b"x" * listing[relative])
    assert set(check_copy(copy, listing)) == set(listing)
    (copy / "conda.yaml").write_bytes(b"short")
    with pytest.raises(CopyRefused, match=r"differs from the registry's listing \(path, bytes\) at \[\('conda.yaml'"):
        check_copy(copy, listing)
    (copy / "conda.yaml").unlink()
    (copy / "MLmodel").unlink()
    with pytest.raises(CopyRefused, match="differs from the registry"):
        check_copy(copy, listing)
    with pytest.raises(CopyRefused, match="no MLmodel"):
        check_copy(copy, {k: v for k, v in listing.items() if k not in ("MLmodel", "conda.yaml")})

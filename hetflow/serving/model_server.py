"""``python -I model_server.py --model-dir DIR --name NAME --version N --socket PATH``: serve one
registered model version's downloaded folder on a Unix socket, speaking TensorFlow Serving's REST
API (and MLflow's ``/invocations``), as its clients send it.

Run inside hetflow's sandbox (``hetflow.serving.replicas``), which has no network of its own: the
socket, in a folder shared with the endpoint, is the one way in (HAProxy connects to
``unix@PATH``). Run as a script, it imports no hetflow (the sandbox carries none on its path): only
the venv's TensorFlow, LiteRT, numpy and PyYAML, and the standard library.

The model is loaded once, before the socket is bound (so a socket that answers is a loaded model),
and straight from its files rather than through ``mlflow.pyfunc``: MLflow's TensorFlow flavor is a
SavedModel whose signatures TF Serving's API names (``signature_name``, the inputs' shapes and
types), hetflow's TFLite pyfunc is one ``.tflite`` file for the LiteRT interpreter, and neither
needs MLflow's import (seconds) nor runs code stored with the model.

Routes (TF Serving's ``http_rest_api_util`` patterns)::

    POST /v1/models/NAME[/versions/N | /labels/LABEL]:predict   {"instances": [...]} or {"inputs": ...}
    GET  /v1/models/NAME[/versions/N | /labels/LABEL][/metadata]
    POST /invocations    MLflow's scoring protocol: dataframe_split, instances or inputs
    GET  /ping           200: loaded (it is, once the socket answers)
    GET  /metrics        Prometheus text: requests, errors (5xx) and latency, by model and version

Which version a label names is the balancer's to route: this server answers any label with its
version. Every answer carries ``X-Model-Name`` and ``X-Model-Version``. Errors are one line
``{"error": "..."}``: 400 bad input (naming the field, the expected shape or type, the limit), 404
another model, version or path, 411/413 a body without a length or over ``--max-body-bytes``,
500 an internal fault (its traceback goes to this server's log, never to the client).

Requests are served by a thread each (``ThreadingHTTPServer``): TensorFlow and LiteRT release the
GIL while they compute, so ``--threads`` computations run at once; uvicorn would add its import
(a second of a start) and an event loop the blocking model calls would not use.
"""

from __future__ import annotations

import argparse
import http.server
import json
import logging
import math
import os
import queue
import re
import signal
import socket
import socketserver
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

log = logging.getLogger("model_server")

DEFAULT_SIGNATURE = "serving_default"
DEFAULT_MAX_INSTANCES = 256
DEFAULT_MAX_BODY_BYTES = 16 << 20
READ_TIMEOUT_SECONDS = 60  # a client that stops sending holds its thread no longer
DRAIN_SECONDS = 10.0
DISCARD_BYTES, DISCARD_SECONDS = (
    64 << 20,
    2.0,
)  # what is read of a refused body, at most  # on SIGTERM, how long requests in flight may take to finish
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# TF Serving's own patterns (model_servers/http_rest_api_util.cc), anchored.
_PREDICT = re.compile(r"/v1/models/([^/:]+)(?:/versions/(\d+)|/labels/([^/:]+))?:(classify|regress|predict)", re.I)
_STATUS = re.compile(r"/v1/models(?:/([^/:]+))?(?:/versions/(\d+)|/labels/([^/:]+))?(?:/(metadata))?", re.I)


class RequestError(Exception):
    """A request this server answers with ``status`` and the one-line ``message``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def bad_request(message: str) -> RequestError:
    return RequestError(400, message)


@dataclass(frozen=True)
class Spec:
    """One named tensor of a signature: its numpy type and shape (-1: any size)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{list(self.shape)} ({self.dtype.name})"


@dataclass(frozen=True)
class Signature:
    inputs: dict[str, Spec]
    outputs: dict[str, Spec]


@dataclass(frozen=True)
class Model:
    """A loaded model: its signatures, and ``run(signature_name, inputs) -> outputs`` by name."""

    flavor: str
    signatures: dict[str, Signature]
    run: Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]


def _tensorflow_model(path: Path, threads: int) -> Model:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    loaded = tf.saved_model.load(str(path))
    functions = dict(loaded.signatures)
    if not functions:
        raise ValueError(f"the SavedModel in {path} has no serving signatures")

    def spec(name: str, tensor: Any) -> Spec:
        shape = tuple(-1 if size is None else size for size in tensor.shape.as_list())
        return Spec(name, np.dtype(tensor.dtype.as_numpy_dtype), shape)

    signatures = {
        key: Signature(
            {name: spec(name, t) for name, t in sorted(function.structured_input_signature[1].items())},
            {name: spec(name, t) for name, t in sorted(function.structured_outputs.items())},
        )
        for key, function in functions.items()
    }

    def run(key: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = functions[key](**{name: tf.constant(array) for name, array in inputs.items()})
        return {name: value.numpy() for name, value in outputs.items()}

    return Model("tensorflow", signatures, run)


def _tflite_model(path: Path, threads: int) -> Model:
    """LiteRT interpreters, ``threads`` of them (one is not safe in two threads at once), each used
    by one request at a time; the file's one input and output, named by its signature if it has one."""
    from ai_edge_litert.interpreter import Interpreter

    interpreters: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(threads):
        interpreters.put([Interpreter(model_path=str(path), num_threads=1), None])  # [interpreter, input shape]
    probe = Interpreter(model_path=str(path))
    [input_detail], [output_detail] = probe.get_input_details(), probe.get_output_details()
    signatures = probe.get_signature_list()
    key, names = next(iter(signatures.items())) if len(signatures) == 1 else (DEFAULT_SIGNATURE, {})
    input_name = (names.get("inputs") or ["input"])[0]
    output_name = (names.get("outputs") or ["output"])[0]

    def spec(name: str, detail: dict) -> Spec:
        return Spec(name, np.dtype(detail["dtype"]), tuple(int(size) for size in detail["shape_signature"]))

    def run(_key: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        entry = interpreters.get()
        try:
            interpreter, shape = entry
            array = np.ascontiguousarray(inputs[input_name])
            if array.shape != shape:
                interpreter.resize_tensor_input(input_detail["index"], array.shape)
                interpreter.allocate_tensors()
                entry[1] = array.shape
            interpreter.set_tensor(input_detail["index"], array)
            interpreter.invoke()
            return {output_name: interpreter.get_tensor(output_detail["index"]).copy()}
        finally:
            interpreters.put(entry)

    signature = Signature({input_name: spec(input_name, input_detail)}, {output_name: spec(output_name, output_detail)})
    return Model("tflite", {key: signature}, run)


def _inside(root: Path, relative: str) -> Path:
    path = (root / relative).resolve()
    if not path.is_relative_to(root.resolve()):
        raise ValueError(f"MLmodel names {relative!r}, outside the model's folder")
    return path


def load_model(model_dir: Path, threads: int) -> Model:
    """The model of an MLflow model folder: the TensorFlow flavor's SavedModel, or hetflow's TFLite
    pyfunc's file (its ``tflite`` artifact)."""
    flavors = yaml.safe_load((model_dir / "MLmodel").read_text()).get("flavors") or {}
    if "tensorflow" in flavors:
        return _tensorflow_model(_inside(model_dir, flavors["tensorflow"]["saved_model_dir"]), threads)
    tflite = ((flavors.get("python_function") or {}).get("artifacts") or {}).get("tflite")
    if tflite:
        return _tflite_model(_inside(model_dir, tflite["path"]), threads)
    raise ValueError(f"{model_dir}/MLmodel has neither a tensorflow flavor nor a tflite artifact: {sorted(flavors)}")


def _json_kind(array: np.ndarray) -> str:
    return {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers with a fraction"}.get(
        array.dtype.kind, "strings or objects"
    )


def as_tensor(value: Any, spec: Spec, field: str) -> np.ndarray:
    """``value`` (JSON lists) as ``spec``'s tensor, or a 400 naming the field and what was expected."""
    expected = f"the model's input {spec.name!r} of shape {spec.describe()}"
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError):  # ragged lists, or integers beyond int64
        raise bad_request(f"{field}: not a rectangular array of numbers; expected {expected}")
    integral = spec.dtype.kind in "iu"
    if array.dtype.kind not in ("iu" if integral else "iuf"):
        raise bad_request(f"{field}: {_json_kind(array)} where {expected} takes {spec.dtype.name} values")
    if len(array.shape) != len(spec.shape) or any(e not in (-1, a) for e, a in zip(spec.shape, array.shape)):
        raise bad_request(f"{field}: shape {list(array.shape)}, expected {expected}")
    if integral and array.size:
        low, high = np.iinfo(spec.dtype).min, np.iinfo(spec.dtype).max
        if array.min() < low or array.max() > high:
            raise bad_request(
                f"{field}: values {array.min()}..{array.max()} out of {spec.dtype.name}'s range {low}..{high}"
            )
    return array.astype(spec.dtype, copy=False)


class Predictor:
    """Requests in TF Serving's and MLflow's JSON turned into the model's tensors and back."""

    def __init__(self, model: Model, max_instances: int):
        self.model = model
        self.max_instances = max_instances

    def signature(self, name: str | None) -> tuple[str, Signature]:
        key = DEFAULT_SIGNATURE if name in (None, "") else name
        if not isinstance(key, str) or key not in self.model.signatures:
            raise bad_request(
                f"signature_name: {key!r} is not one of this model's signatures: {', '.join(self.model.signatures)}"
            )
        return key, self.model.signatures[key]

    def _count(self, field: str, rows: Any) -> None:
        if not isinstance(rows, list):
            raise bad_request(f"{field}: expected a list, got {type(rows).__name__}")
        if not rows:
            raise bad_request(f"{field}: no values in the list")
        if len(rows) > self.max_instances:
            raise bad_request(
                f"{field}: {len(rows)} instances, over this server's limit of {self.max_instances} per request"
            )

    def _rows(self, instances: Any, signature: Signature) -> dict[str, np.ndarray]:
        self._count("instances", instances)
        specs = signature.inputs
        if isinstance(instances[0], dict) and "b64" not in instances[0]:
            if not all(isinstance(row, dict) and row.keys() == specs.keys() for row in instances):
                raise bad_request(f"instances: every object must have exactly the keys {', '.join(specs)}")
            return {n: as_tensor([row[n] for row in instances], s, f"instances[].{n}") for n, s in specs.items()}
        if len(specs) > 1:
            raise bad_request(f"instances: a plain list, but this model takes named inputs {', '.join(specs)}")
        [(name, spec)] = specs.items()
        return {name: as_tensor(instances, spec, "instances")}

    def _columns(self, inputs: Any, signature: Signature, field: str = "inputs") -> dict[str, np.ndarray]:
        specs = signature.inputs
        if not isinstance(inputs, dict):
            inputs = {next(iter(specs)): inputs} if len(specs) == 1 else None
        if inputs is None or inputs.keys() != specs.keys():
            raise bad_request(f"{field}: expected an object with exactly the keys {', '.join(specs)}, or a list")
        for name, value in inputs.items():
            self._count(f"{field}.{name}" if len(specs) > 1 else field, value)
        return {name: as_tensor(inputs[name], spec, field) for name, spec in specs.items()}

    def _run(self, key: str, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        return {name: value.tolist() for name, value in self.model.run(key, inputs).items()}

    def predict(self, request: dict[str, Any]) -> dict[str, Any]:
        """TF Serving's predict: ``instances`` answered with ``predictions``, ``inputs`` with ``outputs``."""
        key, signature = self.signature(request.get("signature_name"))
        if ("instances" in request) == ("inputs" in request):
            raise bad_request("expected exactly one of the keys 'instances' (rows) or 'inputs' (columns)")
        if "instances" in request:
            outputs = self._run(key, self._rows(request["instances"], signature))
            if len(outputs) == 1:
                return {"predictions": next(iter(outputs.values()))}
            count = len(next(iter(outputs.values())))
            return {"predictions": [{name: value[i] for name, value in outputs.items()} for i in range(count)]}
        outputs = self._run(key, self._columns(request["inputs"], signature))
        return {"outputs": next(iter(outputs.values())) if len(outputs) == 1 else outputs}

    def invocations(self, request: dict[str, Any]) -> dict[str, Any]:
        """MLflow's scoring protocol on the default signature; answers ``{"predictions": ...}``."""
        formats = [key for key in ("dataframe_split", "instances", "inputs") if key in request]
        unknown = set(request) - {"dataframe_split", "instances", "inputs", "params"}
        if len(formats) != 1 or unknown:
            raise bad_request("expected exactly one of the keys dataframe_split, instances or inputs (and params)")
        key, signature = self.signature(None)
        if formats == ["dataframe_split"]:
            inputs = self._dataframe(request["dataframe_split"], signature)
        elif formats == ["instances"]:
            inputs = self._rows(request["instances"], signature)
        else:
            inputs = self._columns(request["inputs"], signature)
        outputs = self._run(key, inputs)
        return {"predictions": next(iter(outputs.values())) if len(outputs) == 1 else outputs}

    def _dataframe(self, frame: Any, signature: Signature) -> dict[str, np.ndarray]:
        """A frame's rows, each the flattened tensor of one example, as MLflow reshapes them for a
        tensor signature."""
        if not isinstance(frame, dict) or "data" not in frame:
            raise bad_request("dataframe_split: expected an object with 'columns' and 'data'")
        if len(signature.inputs) != 1:
            raise bad_request(f"dataframe_split: this model takes named inputs {', '.join(signature.inputs)}")
        [(name, spec)] = signature.inputs.items()
        self._count("dataframe_split.data", frame["data"])
        if -1 in spec.shape[1:]:
            raise bad_request(f"dataframe_split: the input {name!r} of shape {spec.describe()} has no fixed row size")
        width = math.prod(size for size in spec.shape[1:])
        flat = as_tensor(frame["data"], Spec(name, spec.dtype, (-1, width)), "dataframe_split.data")
        return {name: flat.reshape((-1, *spec.shape[1:]))}

    def metadata(self, name: str, version: str) -> dict[str, Any]:
        """TF Serving's metadata answer: the signature defs, in its JSON form."""

        def tensor(spec: Spec) -> dict[str, Any]:
            dims = [{"size": str(size), "name": ""} for size in spec.shape]
            dtype = "DT_" + spec.dtype.name.upper().replace("FLOAT32", "FLOAT").replace("FLOAT64", "DOUBLE")
            return {"dtype": dtype, "tensor_shape": {"dim": dims, "unknown_rank": False}, "name": spec.name}

        definitions = {
            key: {
                "inputs": {n: tensor(s) for n, s in sig.inputs.items()},
                "outputs": {n: tensor(s) for n, s in sig.outputs.items()},
                "method_name": "tensorflow/serving/predict",
            }
            for key, sig in self.model.signatures.items()
        }
        return {
            "model_spec": {"name": name, "signature_name": "", "version": version},
            "metadata": {"signature_def": {"signature_def": definitions}},
        }


class Metrics:
    """Prometheus counters and a latency histogram of the prediction requests (predict and
    invocations; not health checks or scrapes). Errors count 5xx answers: a client's bad input is
    not the version's fault."""

    def __init__(self, name: str, version: str):
        self.labels = f'model="{_escape(name)}",version="{_escape(version)}"'
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self.seconds = 0.0
        self.count = 0

    def observe(self, api: str, status: int, seconds: float) -> None:
        with self.lock:
            self.requests[(api, status)] = self.requests.get((api, status), 0) + 1
            self.buckets[next((i for i, le in enumerate(LATENCY_BUCKETS) if seconds <= le), len(LATENCY_BUCKETS))] += 1
            self.seconds += seconds
            self.count += 1

    def text(self) -> str:
        with self.lock:
            lines = ["# HELP model_server_requests_total Prediction requests answered, by API and HTTP status."]
            lines.append("# TYPE model_server_requests_total counter")
            for (api, status), count in sorted(self.requests.items()):
                lines.append(f'model_server_requests_total{{{self.labels},api="{api}",code="{status}"}} {count}')
            errors = sum(count for (_, status), count in self.requests.items() if status >= 500)
            lines += ["# HELP model_server_request_errors_total Prediction requests answered 5xx."]
            lines += ["# TYPE model_server_request_errors_total counter"]
            lines.append(f"model_server_request_errors_total{{{self.labels}}} {errors}")
            lines += ["# HELP model_server_request_duration_seconds Time from a request read to its answer."]
            lines += ["# TYPE model_server_request_duration_seconds histogram"]
            cumulative = 0
            for le, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], self.buckets):
                cumulative += count
                lines.append(f'model_server_request_duration_seconds_bucket{{{self.labels},le="{le}"}} {cumulative}')
            lines.append(f"model_server_request_duration_seconds_sum{{{self.labels}}} {self.seconds}")
            lines.append(f"model_server_request_duration_seconds_count{{{self.labels}}} {self.count}")
        return "\n".join(lines) + "\n"


def _escape(label: str) -> str:
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Service:
    """What one server answers: routes a request to the predictor, with its version's names."""

    def __init__(self, predictor: Predictor, name: str, version: str, max_body_bytes: int):
        self.predictor = predictor
        self.name = name
        self.version = version
        self.max_body_bytes = max_body_bytes
        self.metrics = Metrics(name, version)

    def _check_servable(self, name: str, version: str | None, missing: str) -> None:
        if name != self.name or version not in (None, self.version):
            raise RequestError(404, missing)

    def status(self) -> dict[str, Any]:
        state = {"version": self.version, "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}
        return {"model_version_status": [state]}

    def get(self, path: str) -> tuple[int, dict[str, Any] | str]:
        if path == "/ping":
            return 200, "\n"
        if path == "/metrics":
            return 200, self.metrics.text()
        match = _STATUS.fullmatch(path)
        if not match or not match[1]:
            raise RequestError(404, f"no such path: GET {path}")
        name, version, _label, metadata = match.groups()
        if version is not None:
            self._check_servable(name, version, f"Could not find version {version} of model {name}")
        else:
            self._check_servable(name, None, f"Could not find any versions of model {name}")
        return 200, self.predictor.metadata(self.name, self.version) if metadata else self.status()

    def post(self, path: str, read_body: Callable[[], bytes]) -> dict[str, Any]:
        if path == "/invocations":
            return self.predictor.invocations(_parse(read_body()))
        match = _PREDICT.fullmatch(path)
        if not match:
            raise RequestError(404, f"no such path: POST {path}")
        name, version, _label, method = match.groups()
        requested = f"Specific({name}, {version})" if version else f"Latest({name})"
        self._check_servable(name, version, f"Servable not found for request: {requested}")
        if method.lower() != "predict":
            raise RequestError(404, f"{method} is not served: this model answers :predict")
        return self.predictor.predict(_parse(read_body()))


def _parse(body: bytes) -> dict[str, Any]:
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad_request(f"the body is not JSON: {error}")
    if not isinstance(request, dict):
        raise bad_request(f"the body must be a JSON object, got {type(request).__name__}")
    return request


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a balancer reuses its connections
    server_version, sys_version = "hetflow-model-server", ""
    unread = 0  # bytes of a refused body left unread
    timeout = READ_TIMEOUT_SECONDS
    server: UnixHTTPServer

    def address_string(self) -> str:
        return "unix"  # a Unix socket's peer has no address

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line, an unknown method) in one line of JSON."""
        self.close_connection = True
        self._answer(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def _answer(self, status: int, payload: dict[str, Any] | str) -> None:
        service = self.server.service
        text = payload if isinstance(payload, str) else json.dumps(payload) + "\n"
        body = text.encode()
        self.send_response(status)
        kind = "application/json" if isinstance(payload, dict) else "text/plain; version=0.0.4"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Model-Name", service.name)
        self.send_header("X-Model-Version", service.version)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or length is None:
            self.close_connection = True
            raise RequestError(411, "a request body needs a Content-Length header (no chunked encoding)")
        if not length.isdigit():
            self.close_connection = True
            raise bad_request(f"Content-Length: {length!r} is not a number of bytes")
        limit = self.server.service.max_body_bytes
        if int(length) > limit:
            self.close_connection = True
            self.unread = int(length)
            raise RequestError(413, f"the body is {int(length)} bytes, over this server's limit of {limit}")
        return self.rfile.read(int(length))

    def _discard_unread(self) -> None:
        """Read (a bounded share of) a refused body before closing, so that a client still sending it
        reads the refusal instead of a reset connection (nginx's lingering close)."""
        left = min(self.unread, DISCARD_BYTES)
        self.connection.settimeout(DISCARD_SECONDS)
        try:
            while left > 0 and (chunk := self.rfile.read(min(left, 1 << 16))):
                left -= len(chunk)
        except OSError:
            pass  # the client gave up: nothing more to tell it

    def _serve(self, method: str) -> None:
        service = self.server.service
        path = self.path.split("?", 1)[0]
        started = time.perf_counter()
        with self.server.in_flight:
            try:
                if method == "GET":
                    status, payload = service.get(path)
                else:
                    status, payload = 200, service.post(path, self._read_body)
            except RequestError as error:
                status, payload = error.status, {"error": " ".join(str(error).split())}
            except Exception as error:  # noqa: BLE001 - a fault of the model's or ours: one line out, the traceback logged
                log.error("%s %s failed:\n%s", method, path, traceback.format_exc())
                status, payload = 500, {"error": f"internal error ({type(error).__name__}); see the model server's log"}
            self._answer(status, payload)
            if self.unread:
                self._discard_unread()
            api = "invocations" if path == "/invocations" else "predict" if path.startswith("/v1/") else None
            if method == "POST" and api:
                service.metrics.observe(api, status, time.perf_counter() - started)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")


class InFlight:
    """How many requests are being answered, so that SIGTERM lets them finish."""

    def __init__(self):
        self.count = 0
        self.changed = threading.Condition()

    def __enter__(self) -> None:
        with self.changed:
            self.count += 1

    def __exit__(self, *exc_info) -> None:
        with self.changed:
            self.count -= 1
            self.changed.notify_all()

    def drain(self, seconds: float) -> int:
        """Wait up to ``seconds`` for none in flight; how many were still."""
        with self.changed:
            self.changed.wait_for(lambda: self.count == 0, timeout=seconds)
            return self.count


class UnixHTTPServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    address_family = socket.AF_UNIX
    daemon_threads = True  # idle keep-alive connections do not hold the exit: SIGTERM drains in-flight requests
    request_queue_size = 128

    def __init__(self, path: str, service: Service):
        self.service = service
        self.in_flight = InFlight()
        super().__init__(path, Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone mid-answer is one line in the log; anything else its traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.info("a client went away: %s", error)
        else:
            log.error("a connection failed:\n%s", traceback.format_exc())

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # HTTPServer's would look up a host name
        self.server_name, self.server_port = "localhost", 0


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="the version's MLflow model folder")
    parser.add_argument("--name", required=True, help="the registered model's name, as clients ask for it")
    parser.add_argument("--version", required=True, help="the version served: digits")
    parser.add_argument("--socket", required=True, help="the Unix socket to listen on (replaced if there)")
    parser.add_argument("--max-instances", type=int, default=DEFAULT_MAX_INSTANCES, help="instances per request")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--threads", type=int, default=1, help="computations at once (TensorFlow's, LiteRT's)")
    arguments = parser.parse_args(argv)
    if not arguments.version.isdigit():
        parser.error(f"--version: {arguments.version!r} is not a version number")
    for option in ("max_instances", "max_body_bytes", "threads"):
        if getattr(arguments, option) < 1:
            parser.error(f"--{option.replace('_', '-')}: must be at least 1")
    return arguments


def main(argv: list[str]) -> int:
    arguments = _arguments(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    started = time.monotonic()
    model = load_model(arguments.model_dir, arguments.threads)
    service = Service(
        Predictor(model, arguments.max_instances), arguments.name, arguments.version, arguments.max_body_bytes
    )
    if os.path.exists(arguments.socket):
        os.unlink(arguments.socket)  # a replica's earlier process left it
    httpd = UnixHTTPServer(arguments.socket, service)

    def terminate(signum: int, _frame: Any) -> None:
        threading.Thread(target=httpd.shutdown, daemon=True).start()  # shutdown() waits for serve_forever

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    log.info(
        "serving %s version %s (%s, signatures %s) on %s, loaded in %.2f s",
        arguments.name,
        arguments.version,
        model.flavor,
        ", ".join(model.signatures),
        arguments.socket,
        time.monotonic() - started,
    )
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        left = httpd.in_flight.drain(DRAIN_SECONDS)
        httpd.server_close()
        os.unlink(arguments.socket)
        log.info("stopped%s", f"; {left} requests still in flight" if left else "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What one model server answers, by path (TF Serving's routes, MLflow's ``/invocations``, ``/ping``,
``/metrics``), with its model's name and version: the HTTP layer aside."""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from predictor import Predictor
from request_error import RequestError, bad_request
from request_metrics import Metrics

# TF Serving's own patterns (model_servers/http_rest_api_util.cc), anchored.
_PREDICT = re.compile(r"/v1/models/([^/:]+)(?:/versions/(\d+)|/labels/([^/:]+))?:(classify|regress|predict)", re.I)
_STATUS = re.compile(r"/v1/models(?:/([^/:]+))?(?:/versions/(\d+)|/labels/([^/:]+))?(?:/(metadata))?", re.I)


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

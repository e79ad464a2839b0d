"""``python -I model_server --model-dir DIR --name NAME --version N --socket PATH``: serve one
registered model version's downloaded folder on a Unix socket, speaking TensorFlow Serving's REST
API (and MLflow's ``/invocations``), as its clients send it.

Run inside hetflow's sandbox (``hetflow.serving.replicas``), which has no network of its own: the
socket, in a folder shared with the endpoint, is the one way in (HAProxy connects to
``unix@PATH``). Run as a folder (``python -I`` puts it, not the working directory, on ``sys.path``;
its modules import each other by plain name), it imports no hetflow (the sandbox carries none on
its path): only the venv's TensorFlow, LiteRT, numpy and PyYAML, and the standard library.

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
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_INSTANCES, DRAIN_SECONDS
from loading import load_model
from predictor import Predictor
from service import Service
from unix_http import UnixHTTPServer

log = logging.getLogger("model_server")


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

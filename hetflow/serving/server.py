"""Infra validation: a registered model served by MLflow's own model server, queried over HTTP.

As TFX's InfraValidator does before a model is pushed, a candidate is started the way MLflow
serves it (MLflow's scoring app under ``uvicorn``, the command ``mlflow models serve --env-manager
local`` execs and MLflow's model containers run, on a loopback port, in its own process group, with
a clean environment), asked for predictions on raw test examples, timed, and stopped. The model
runs only in that server process: loading a registered model can run its code (MLflow's "models
from code"), and the pipeline never does.

The server is started from MLflow's own command (``scoring_server.get_cmd``) rather than through
the ``mlflow`` CLI, which would import MLflow's whole command line, seconds of CPU, only to exec
that same command.

The server runs sandboxed (``hetflow.sandbox``: bubblewrap, an unprivileged uid, no capabilities,
dying with the process that started it): the pipeline downloads the version's files (a copy,
nothing loaded) and the server serves that folder, seeing the system, the interpreter and nothing of
HETFLOW_HOME, the MLflow store, Airflow's home or the user's home, with no registry credentials, in
a network namespace of its own. The pipeline reaches it through a Unix socket that
``hetflow/serving/relay.py`` relays to the server's port inside. Where no sandbox can be had the
check is refused unless the operator accepted running unisolated. The check records which.

The runner's life, as TFX's model_server_runners draw it::

    start() ──► wait_until_running(deadline) ──► predict() ... ──► stop()
       │              │ ServingError: exited, or not healthy by the deadline    ▲
       └──────────────┴─────────────────────────────────────────────────────────┘

``stop()`` is called whenever ``start()`` was, does not assume that ``start()`` finished, ends
within ``STOP_GRACE_SECONDS`` plus a SIGKILL's wait, and never raises.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hetflow import sandbox
from hetflow.serving import relay as serving_relay
from hetflow.serving.server_process import (
    REQUEST_TIMEOUT_SECONDS,
    START_DEADLINE_SECONDS,
    ServingError,
    UnixHTTPConnection,
    copy_version,
    isolation,
    launch,
    stop_group,
    wait_until_healthy,
)

log = logging.getLogger("hetflow.serving")

REQUEST_BATCH = 256  # examples per /invocations request when scoring many
CHECK_EXAMPLES = 256  # test examples compared with the exported model
LATENCY_REQUESTS = 100
# Served and exported model compute the same graph / interpreter: only float rounding may differ.
LOGIT_TOLERANCE = 1e-3
_LOG_TAIL_CHARS = 1500


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scoring_command(model_path: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """MLflow's command serving the model folder ``model_path`` on 127.0.0.1:``port`` with one
    worker, and the variables it adds to the environment (which model, its request timeout)."""
    from mlflow.pyfunc import scoring_server

    command, env = scoring_server.get_cmd(str(model_path), port=port, host="127.0.0.1", nworkers=1)
    added = {key: value for key, value in env.items() if os.environ.get(key) != value}
    program, *arguments = shlex.split(command)
    return [str(Path(sys.executable).parent / program), *arguments], added


class ModelServer:
    """MLflow's model server for one model URI, serving a copy of its files; its output goes to
    ``log_path``.

    :param model_uri: e.g. ``models:/NAME/VERSION``.
    :param tracking_uri: the registry the model's files are copied from.
    :param log_path: the server's stdout and stderr; its folder is also the server's working
        directory (uvicorn puts that on ``sys.path``, so it must hold no Python modules).
    """

    def __init__(self, model_uri: str, tracking_uri: str, log_path: Path):
        self.model_uri = model_uri
        self.tracking_uri = tracking_uri
        self.log_path = log_path
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self._copy: Path | None = None  # the downloaded version the server serves
        self._socket: Path | None = None  # where the pipeline reaches a sandboxed server
        self.isolation = isolation(f"the model server of {model_uri}", tracking_uri)

    def start(self) -> None:
        self.port = free_port()
        model = self._download()
        command, scoring_env = scoring_command(model, self.port)
        read_write = []
        if self.isolation["confined"]:
            sockets = self._copy / "socket"
            sockets.mkdir()
            sandbox.hand_over(sockets)
            self._socket = sockets / "http.sock"
            read_write = [str(sockets)]
            # Run as a script, not a module: the server's environment must not carry hetflow on its path.
            command = [sys.executable, serving_relay.__file__, str(self._socket), str(self.port), "--", *command]
        self.process = launch(
            command, self.isolation, self.log_path, scoring_env, read_write=read_write, read_only=[str(model)]
        )

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._socket is not None:
            return UnixHTTPConnection(self._socket, timeout)
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def _request(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        connection = self._connection(timeout)
        try:
            connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def _download(self) -> Path:
        """The version's files, copied into a temporary folder that ``stop()`` removes (mkdtemp's
        0700: the sandbox still reads it, root's view recreates the folders above what it shows)."""
        self._copy = Path(tempfile.mkdtemp(prefix="hetflow-served-"))
        (self._copy / "model").mkdir()  # beside it, the server's socket (see start)
        return copy_version(self.model_uri, self.tracking_uri, self._copy / "model")

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:].strip()
        except OSError:
            return ""

    def wait_until_running(self, deadline: float) -> None:
        """Return once ``/ping`` answers 200; ``deadline`` is a ``time.monotonic()`` value."""
        wait_until_healthy(self.process, self._connection, deadline, self.log_tail)

    def _invoke(self, images: np.ndarray) -> np.ndarray:
        body = json.dumps({"inputs": images.tolist()}).encode()
        try:
            status, answer = self._request("POST", "/invocations", body, timeout=REQUEST_TIMEOUT_SECONDS)
            if status != 200:
                raise ServingError(f"/invocations answered {status}: {answer[:500].decode(errors='replace')}")
            return np.asarray(json.loads(answer)["predictions"], dtype=np.float32)
        except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
            raise ServingError(f"/invocations failed: {error!r}")

    def predict(self, images: np.ndarray) -> np.ndarray:
        return np.concatenate(
            [self._invoke(images[i : i + REQUEST_BATCH]) for i in range(0, len(images), REQUEST_BATCH)]
        )

    def stop(self) -> None:
        self._stop_server()
        if self._copy is not None:
            shutil.rmtree(self._copy, ignore_errors=True)
            self._copy = None

    def _stop_server(self) -> None:
        if self.process is not None:
            stop_group(self.process, f"the model server of {self.model_uri}")

    def __enter__(self) -> ModelServer:
        try:
            self.start()
            self.wait_until_running(time.monotonic() + START_DEADLINE_SECONDS)
        except BaseException:  # __exit__ does not run when __enter__ raises
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _latencies_ms(server: ModelServer, images: np.ndarray) -> np.ndarray:
    server._invoke(images[:1])  # warm-up
    times = []
    for i in range(LATENCY_REQUESTS):
        started = time.perf_counter()
        server._invoke(images[i % len(images)][np.newaxis])
        times.append(time.perf_counter() - started)
    return np.asarray(times) * 1000


def served_check(
    model_uri: str,
    tracking_uri: str,
    images: np.ndarray,
    expected: np.ndarray,
    log_path: Path,
    deadline_seconds: float = START_DEADLINE_SECONDS,
) -> dict[str, Any]:
    """Serve ``model_uri``, compare its predictions on ``images`` with ``expected`` (the exported
    model's logits), time ``LATENCY_REQUESTS`` requests of one example, stop the server.

    The model's faults (no start, too slow, errors, disagreement) do not raise: ``passed`` is
    False and ``reason`` says why. ``port`` and ``pgid`` say where the server was.
    """
    server = ModelServer(model_uri, tracking_uri, log_path)
    check: dict[str, Any] = {
        "model_uri": model_uri,
        "passed": False,
        "examples": len(images),
        "isolation": server.isolation,
    }
    started = time.monotonic()
    try:
        server.start()
        check.update(port=server.port, pgid=server.process.pid)
        server.wait_until_running(started + deadline_seconds)
        check["start_seconds"] = time.monotonic() - started
        served = server.predict(images)
        if served.shape != expected.shape:
            raise ServingError(f"served predictions have shape {served.shape}, the exported model's {expected.shape}")
        check["agreement"] = float(np.mean(np.argmax(served, axis=1) == np.argmax(expected, axis=1)))
        check["max_logit_difference"] = float(np.max(np.abs(served - expected)))
        latencies = _latencies_ms(server, images)
        check.update(
            latency_p50_ms=float(np.percentile(latencies, 50)),
            latency_p99_ms=float(np.percentile(latencies, 99)),
            latency_requests=len(latencies),
        )
        if check["agreement"] < 1.0 or check["max_logit_difference"] > LOGIT_TOLERANCE:
            raise ServingError(
                f"served predictions disagree with the exported model: agreement {check['agreement']:.4f} on "
                f"{len(images)} test examples, logits differ by up to {check['max_logit_difference']:.3g} "
                f"(tolerance {LOGIT_TOLERANCE})"
            )
        check["passed"] = True
    except (ServingError, OSError) as error:
        check["reason"] = str(error)
    finally:
        server.stop()
        check["seconds"] = time.monotonic() - started
    log.info("served check of %s: %s", model_uri, describe(check))
    return check


def describe(check: dict[str, Any]) -> str:
    """One line for a registry description or a run tag."""
    if not check["passed"]:  # one line: the reason may end with the server's log (kept whole in the run's serving/)
        return f"failed: {' '.join(check['reason'].split())}"
    return (
        f"passed: MLflow's model server up in {check['start_seconds']:.1f} s; agreement {check['agreement']:.4f} "
        f"with the exported model on {check['examples']} test examples (logits within "
        f"{check['max_logit_difference']:.2g}); latency p50 {check['latency_p50_ms']:.2f} ms, "
        f"p99 {check['latency_p99_ms']:.2f} ms over {check['latency_requests']} requests of one example"
    )

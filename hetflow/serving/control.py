"""The endpoint's control socket: how the ``hetflow_deploy`` DAG reaches a running ``hetflow serve``.

A Unix socket at ``$HETFLOW_HOME/serve/control.sock`` (mode 0600, in a folder of mode 0700), so
that a DAG task of the same user and home finds it with no setting. One request per connection, a
JSON line naming a model and a version; the answer is a JSON line: where the endpoint's rollout of
that version stands (``pending``, ``running``, ``promoted``, ``rolled back``, or ``refused`` with
the reason), with the rollout's record so far. Asking never starts a second rollout: the endpoint
rolls out what its follower reads from the registry, and a request only makes it read at once.

Nothing received runs as code or names a path: a request is two strings, checked against a
pattern, and only looked up.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import socketserver
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetflow.paths import hetflow_home

log = logging.getLogger("hetflow.serving")

# The Asset that register's event names when it moves ``champion``, and the deploy DAG is scheduled on.
CHAMPION_ASSET_URI = "hetflow://registry/champion"
MAX_LINE_BYTES = 4096  # a request is two short strings
MAX_ANSWER_BYTES = 1 << 20  # a rollout's record: its steps and their figures
TIMEOUT_SECONDS = 10.0
# MLflow's registered model names: printable, no control characters; only compared, never a path.
MODEL_PATTERN = re.compile(r"[^\x00-\x1f\x7f]{1,256}")
VERSION_PATTERN = re.compile(r"[1-9][0-9]{0,9}")
FIELDS = ("model", "version")


class BadRequest(ValueError):
    """One line naming the field and what it allows."""


class NoEndpoint(RuntimeError):
    """No endpoint listens on the control socket."""


class SocketTaken(RuntimeError):
    """Another endpoint answers on the control socket already."""


def socket_path(home: Path | None = None) -> Path:
    return (home or hetflow_home()) / "serve" / "control.sock"


def parse_target(value: Any) -> tuple[str, str]:
    """``{"model": NAME, "version": N}`` as (model, version); BadRequest names what is wrong."""
    if not isinstance(value, dict):
        raise BadRequest(f"a request is a JSON object with {' and '.join(FIELDS)}, not {type(value).__name__}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise BadRequest(f"{unknown[0]}: not a field; allowed: {', '.join(FIELDS)}")
    model, version = value.get("model"), value.get("version")
    if not isinstance(model, str) or not MODEL_PATTERN.fullmatch(model):
        raise BadRequest(f"model {model!r}: a registered model's name, 1 to 256 printable characters")
    if isinstance(version, int) and not isinstance(version, bool):
        version = str(version)
    if not isinstance(version, str) or not VERSION_PATTERN.fullmatch(version):
        raise BadRequest(f'version {version!r}: a model version\'s number, 1 or more (e.g. 3 or "3")')
    return model, version


class ControlServer:
    """Answers each request with ``answer(model, version)``, in a thread per connection."""

    def __init__(self, path: Path, answer: Callable[[str, str], dict[str, Any]]):
        self.path = path
        self.answer = answer
        self._server: _Server | None = None

    def start(self) -> None:
        self._claim()
        self._server = _Server(str(self.path), _Handler)
        self._server.answer = self.answer
        os.chmod(self.path, 0o600)  # the folder (0700) kept everyone else out in between
        threading.Thread(target=self._server.serve_forever, name="endpoint-control", daemon=True).start()
        log.info("control socket for the deploy DAG: %s", self.path)

    def _claim(self) -> None:
        """The folder made private; a socket left by an endpoint that died is removed, one that
        answers is another endpoint's, and anything else at the name is refused."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.path.parent, 0o700)
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise SocketTaken(f"{self.path} exists and is not a socket: refused (remove it to serve the deploy DAG)")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(2)
                probe.connect(str(self.path))
        except OSError:
            self.path.unlink()
            return
        raise SocketTaken(f"another endpoint answers the deploy DAG on {self.path}")

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        self.path.unlink(missing_ok=True)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    answer: Callable[[str, str], dict[str, Any]]


class _Handler(socketserver.StreamRequestHandler):
    timeout = TIMEOUT_SECONDS

    def handle(self) -> None:
        try:
            line = self.rfile.readline(MAX_LINE_BYTES + 1)
        except OSError:  # silent past the timeout, or gone: no one to answer
            return
        try:
            if len(line) > MAX_LINE_BYTES or not line.endswith(b"\n"):
                raise BadRequest(f"a request is one JSON line of at most {MAX_LINE_BYTES} bytes")
            try:
                request = json.loads(line)
            except ValueError as error:
                raise BadRequest(f"not JSON: {error}") from None
            answer = self.server.answer(*parse_target(request))
        except BadRequest as error:
            answer = {"state": "bad request", "reason": str(error)}
        except Exception as error:  # the registry unreachable, say: the asker gets the line, the log the rest
            log.warning("control socket: could not answer", exc_info=True)
            answer = {"state": "error", "reason": " ".join(str(error).split())[:300] or type(error).__name__}
        self.wfile.write(json.dumps(answer).encode() + b"\n")


def ask(model: str, version: str, path: Path | None = None) -> dict[str, Any]:
    """Where the running endpoint's rollout of (model, version) stands; NoEndpoint when none listens."""
    path = path or socket_path()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(TIMEOUT_SECONDS)
        try:
            connection.connect(str(path))
        except OSError as error:
            if error.errno in (errno.ENOENT, errno.ECONNREFUSED):
                raise NoEndpoint(
                    f"no hetflow endpoint is running (nothing listens on {path}): start one with "
                    "`make serve` (hetflow serve) and trigger hetflow_deploy again"
                ) from None
            raise
        connection.sendall(json.dumps({"model": model, "version": version}).encode() + b"\n")
        with connection.makefile("rb") as answers:
            line = answers.readline(MAX_ANSWER_BYTES + 1)
    if not line.endswith(b"\n"):
        raise NoEndpoint(f"the endpoint on {path} closed the connection without a whole answer")
    return json.loads(line)

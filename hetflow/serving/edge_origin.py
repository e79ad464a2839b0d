"""The edge origin: what a phone polls for (the TFLite champion's manifest) and fetches (its file),
served on a Unix socket behind the endpoint's HAProxy, which routes ``/v1/edge/`` to it::

    GET /v1/edge/<registered model>/manifest      JSON: version, sha256, size, LiteRT latency, metadata
    GET /v1/edge/<registered model>/model.tflite  the file; ETag its sha256, 304 on If-None-Match

It follows ``champion`` on its own, one registry look every few seconds (``follower.champions``): a new
champion's file is copied and checked against its sha256 (``edge.fetch_edge_file``) before its
manifest is served, so a manifest always names a file that is there. A model whose champion has no
edge bundle (the float model, a version registered before the edge tags) answers 404 and why.

Requests only read what the follow put in memory: the model's name in a path is a key, checked
against the registry's names' pattern, and never part of a file's path; files come only from the
checked copies in this origin's folder.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import re
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from hetflow.serving.edge import EdgeBundleError, fetch_edge_file, version_manifest
from hetflow.serving.follower import CHAMPION, POLL_SECONDS, champions
from hetflow.serving.unix_server import UnixHTTPServer
from mlflow import MlflowClient

log = logging.getLogger("hetflow.serving")

PREFIX = "/v1/edge/"
_ROUTE = re.compile(r"^/v1/edge/(?P<model>[^/]*)/(?P<item>manifest|model\.tflite)$")
# A registered model's name as the balancer takes it; no leading dot, so never "." or ".."
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")
_USAGE = f"no such path: use {PREFIX}<model>/manifest or {PREFIX}<model>/model.tflite"


@dataclass(frozen=True)
class Bundle:
    manifest: dict[str, Any]
    path: Path  # the checked copy

    @property
    def etag(self) -> str:
        return f'"{self.manifest["sha256"]}"'


class EdgeOrigin:
    """start(), then it serves and follows the champions of ``names`` (every model's if empty); stop()."""

    def __init__(
        self, client: MlflowClient, folder: Path, names: tuple[str, ...] = (), poll_seconds: float = POLL_SECONDS
    ):
        self.client, self.names, self.poll_seconds = client, names, poll_seconds
        self.folder = Path(folder)
        self.files = self.folder / "files"
        self.socket_path = self.folder / "origin.sock"
        self.bundles: dict[str, Bundle] = {}
        self.refused: dict[str, tuple[str, str]] = {}  # model → (its champion's version, why it is not served)
        self._lock = threading.Lock()  # a file is opened under it, and a replaced one removed after it
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._httpd: _UnixHTTPServer | None = None

    def start(self) -> EdgeOrigin:
        self.files.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stale in self.files.iterdir():  # an earlier run's copies: only this run's checked ones are served
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        self.socket_path.unlink(missing_ok=True)
        self._httpd = _UnixHTTPServer(str(self.socket_path), self)
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True),
            threading.Thread(target=self._follow, daemon=True, name="edge-origin-follow"),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Raises no error: it runs on the way out of failures too."""
        self._stop.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
            self.socket_path.unlink(missing_ok=True)
        for thread in self._threads:
            thread.join(timeout=30)
        self._threads = []

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # the registry unreachable: what is served stays, tried again at the next poll
                log.exception("edge origin: could not read the champions")
            self._stop.wait(self.poll_seconds)

    def refresh(self) -> None:
        """One look at the registry: each model's manifest moves to its champion once its file is checked."""
        current = champions(self.client, self.names)
        for model in set(self.bundles) - set(current):
            self._replace(model, None)
        for model in set(self.refused) - set(current):
            del self.refused[model]
        for model, version in current.items():
            served = self.bundles.get(model)
            if (served and str(served.manifest["version"]) == version) or self.refused.get(model, ("",))[0] == version:
                continue
            try:
                manifest = version_manifest(self.client, model, version)
                path = fetch_edge_file(self.client, model, version, self.files)
            except EdgeBundleError as error:  # this version is never served; its model answers why
                self.refused[model] = (version, str(error))
                self._replace(model, None)
                continue
            except Exception:  # noqa: BLE001 - a download cut short: the last checked file stays, tried again
                log.exception("edge origin: %s v%s could not be fetched", model, version)
                continue
            self.refused.pop(model, None)
            self._replace(model, Bundle({**manifest, "alias": CHAMPION, "url": f"{PREFIX}{model}/model.tflite"}, path))
            log.info("edge origin: %s v%s is served (sha256 %s)", model, version, manifest["sha256"][:12])

    def _replace(self, model: str, bundle: Bundle | None) -> None:
        with self._lock:
            old = self.bundles.pop(model, None)
            if bundle is not None:
                self.bundles[model] = bundle
        if old is not None and (bundle is None or old.path != bundle.path):
            old.path.unlink(missing_ok=True)  # a download in flight keeps its open file

    def answer(self, path: str) -> tuple[int, dict[str, Any] | None, Bundle | None, BinaryIO | None]:
        """(status, JSON or None, the bundle, its file opened for model.tflite) for a GET of ``path``."""
        route = _ROUTE.match(path.split("?", 1)[0])
        if route is None:
            return 404, {"error": _USAGE}, None, None
        model, item = route["model"], route["item"]
        if not _MODEL_NAME.match(model):
            return (
                400,
                {
                    "error": f"model: {model[:100]!r} is not a registered model's name (1 to 100 of "
                    "A-Z a-z 0-9 . _ -, not starting with '.')"
                },
                None,
                None,
            )
        with self._lock:
            bundle = self.bundles.get(model)
            opened = open(bundle.path, "rb") if bundle is not None and item == "model.tflite" else None
        if bundle is None:
            reason = self.refused.get(model, ("", f"model {model!r} has no champion"))[1]
            return 404, {"error": f"no TFLite champion for {model!r}: {reason}"}, None, None
        return 200, bundle.manifest if opened is None else None, bundle, opened


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version, sys_version = "hetflow-edge-origin", ""
    timeout = 60  # a client that stops reading holds its thread no longer
    server: _UnixHTTPServer

    def address_string(self) -> str:
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request, another method than GET or HEAD) in one line."""
        self.close_connection = True
        self._send_json(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def _send_json(self, status: int, payload: dict[str, Any], bundle: Bundle | None = None) -> None:
        body = (json.dumps(payload) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache")
        self._send_version(bundle)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_version(self, bundle: Bundle | None) -> None:
        if bundle is not None:
            self.send_header("X-Model-Name", bundle.manifest["model"])
            self.send_header("X-Model-Version", str(bundle.manifest["version"]))

    def _send_file(self, bundle: Bundle, opened: BinaryIO) -> None:
        with opened:
            asked = {tag.strip().removeprefix("W/") for tag in self.headers.get("If-None-Match", "").split(",")}
            unchanged = bundle.etag in asked or "*" in asked
            self.send_response(304 if unchanged else 200)
            self.send_header("ETag", bundle.etag)
            self.send_header("Cache-Control", "no-cache")  # a cache asks again, and gets a 304 while it holds
            self._send_version(bundle)
            if not unchanged:
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(os.fstat(opened.fileno()).st_size))
                name = f"{bundle.manifest['model']}-v{bundle.manifest['version']}.tflite"
                self.send_header("Content-Disposition", f'attachment; filename="{name}"')
            self.end_headers()
            if not unchanged and self.command != "HEAD":
                shutil.copyfileobj(opened, self.wfile, 1 << 16)

    def do_GET(self) -> None:
        status, payload, bundle, opened = self.server.origin.answer(self.path)
        if opened is not None:
            self._send_file(bundle, opened)
        else:
            self._send_json(status, payload, bundle)

    do_HEAD = do_GET


class _UnixHTTPServer(UnixHTTPServer):
    def __init__(self, path: str, origin: EdgeOrigin):
        self.origin = origin
        super().__init__(path, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # a device gone mid-download
            log.info("edge origin: a client went away: %s", error)
        else:
            log.exception("edge origin: a request failed")

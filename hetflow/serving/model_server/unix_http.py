"""HTTP/1.1 on a Unix socket, a thread a request: the service's answers in one line of JSON each,
refused bodies read (a bounded share) before closing, requests in flight counted so that SIGTERM lets
them finish."""

from __future__ import annotations

import http.server
import json
import logging
import socket
import socketserver
import sys
import threading
import time
import traceback
from typing import Any

from request_error import RequestError, bad_request
from service import Service

log = logging.getLogger("model_server")

READ_TIMEOUT_SECONDS = 60  # a client that stops sending holds its thread no longer
DISCARD_BYTES, DISCARD_SECONDS = 64 << 20, 2.0  # what is read of a refused body, at most


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

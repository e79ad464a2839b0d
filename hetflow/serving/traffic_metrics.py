"""The endpoint's ``GET /metrics``: every request HAProxy answered, per model and version, in
Prometheus' text format: a counter by status code and a latency histogram, as the client saw them
(HAProxy's ``%Ta``: from the request's arrival to the answer's last byte, retries included).

HAProxy's own exporter (``/metrics/haproxy``) counts per server and averages response times; a
histogram per version is what a canary's latency is watched with, so it is built here from the same
log lines the rollout judges by (``traffic_log``), and served on a Unix socket behind HAProxy.
A request no server took (``<NOSRV>``: every replica down or drained) counts under version ``none``.
"""

from __future__ import annotations

import bisect
import http.server
import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetflow.serving.traffic_log import Answer
from hetflow.serving.unix_server import UnixHTTPServer

log = logging.getLogger("hetflow.serving")

# Seconds; a predict of the default models takes a few milliseconds, a slow candidate tens to hundreds.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SERVER = re.compile(r"^(?P<model>.+)-v(?P<version>\d+)-r\d+$")  # the balancer's names: MODEL-vN-rK
_MODEL_BACKEND = re.compile(r"^m\d+(s\d+)?$")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Series:
    def __init__(self):
        self.codes: dict[int, int] = {}
        self.buckets = [0] * (len(BUCKETS) + 1)  # the last one: over every bound (+Inf only)
        self.seconds = 0.0

    def observe(self, status: int, seconds: float) -> None:
        self.codes[status] = self.codes.get(status, 0) + 1
        if status > 0:  # an answer: its time is a latency; no answer (-1) has none
            self.buckets[bisect.bisect_left(BUCKETS, seconds)] += 1
            self.seconds += seconds


class TrafficMetrics:
    """``observe`` each logged answer; ``text`` the Prometheus exposition of all since start."""

    def __init__(self, model_of_backend: Callable[[str], str | None]):
        self.model_of_backend = model_of_backend  # a request no server took names only its backend
        self._series: dict[tuple[str, str], _Series] = {}
        self._lock = threading.Lock()

    def observe(self, answer: Answer) -> None:
        if not _MODEL_BACKEND.match(answer.backend):
            return  # the endpoint's own answers (the edge bundle, these metrics)
        named = _SERVER.match(answer.server)
        model, version = (
            (named["model"], named["version"]) if named else (self.model_of_backend(answer.backend), "none")
        )
        if model is None:
            return
        with self._lock:
            self._series.setdefault((model, version), _Series()).observe(answer.status, answer.active_ms / 1000.0)

    def text(self) -> str:
        with self._lock:
            series = sorted(self._series.items())
            lines = [
                "# HELP hetflow_endpoint_requests_total Requests answered through the endpoint, by status (-1: none).",
                "# TYPE hetflow_endpoint_requests_total counter",
            ]
            for (model, version), one in series:
                for status, count in sorted(one.codes.items()):
                    lines.append(
                        f'hetflow_endpoint_requests_total{{{_labels(model, version)},code="{status}"}} {count}'
                    )
            name = "hetflow_endpoint_request_duration_seconds"
            lines += [
                f"# HELP {name} Time from a request's arrival to its answer's last byte, answered requests.",
                f"# TYPE {name} histogram",
            ]
            for (model, version), one in series:
                labels, cumulative = _labels(model, version), 0
                for bound, count in zip((*BUCKETS, "+Inf"), one.buckets, strict=True):
                    cumulative += count
                    lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
                lines += [f"{name}_sum{{{labels}}} {one.seconds:.6f}", f"{name}_count{{{labels}}} {cumulative}"]
        return "\n".join(lines) + "\n"


def _labels(model: str, version: str) -> str:
    # Model names are the registry's (letters, digits, . _ -) and versions digits: nothing to escape.
    return f'model="{model}",version="{version}"'


class MetricsOrigin:
    """``TrafficMetrics.text`` on a Unix socket, for the balancer's ``/metrics`` route; start(), stop()."""

    def __init__(self, metrics: TrafficMetrics, socket_path: Path):
        self.metrics, self.socket_path = metrics, socket_path
        self._httpd: _UnixHTTPServer | None = None

    def start(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        self._httpd = _UnixHTTPServer(str(self.socket_path), self.metrics)
        threading.Thread(target=self._httpd.serve_forever, name="endpoint-metrics", daemon=True).start()

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        self.socket_path.unlink(missing_ok=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version, sys_version = "hetflow-endpoint-metrics", ""
    timeout = 30
    server: _UnixHTTPServer

    def address_string(self) -> str:
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)

    def do_GET(self) -> None:
        body = self.server.metrics.text().encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_HEAD = do_GET


class _UnixHTTPServer(UnixHTTPServer):
    def __init__(self, path: str, metrics: TrafficMetrics):
        self.metrics = metrics
        super().__init__(path, _Handler)

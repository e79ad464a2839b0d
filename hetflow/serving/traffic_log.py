"""Every request HAProxy answered, as HAProxy logs it, kept for a bounded window: the figures a
canary step is judged on (each version's requests, errors and latency percentiles).

HAProxy's statistics give per-server counters and a moving average of response times, not
percentiles; its log gives each request's server, status and timings. HAProxy sends one raw line
per request (``LOG_FORMAT``) to a Unix datagram socket this module binds; nothing else can write
there (the socket's folder is the endpoint's, mode 0700).
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# backend, server, HTTP status (-1: no answer), total active time in ms (%Ta: from the request's
# arrival to the answer's last byte), retries (%rc).
LOG_FORMAT = "%b %s %ST %Ta %rc"
_MAX_RECORDS = 200_000  # the window's bound in memory, whatever the request rate


@dataclass(frozen=True)
class Answer:
    at: float  # time.monotonic() when it was received
    backend: str
    server: str
    status: int
    active_ms: float


def parse(line: str, at: float) -> Answer | None:
    fields = line.split()
    if len(fields) < 4:
        return None
    try:
        return Answer(at, fields[0], fields[1], int(fields[2]), float(fields[3]))
    except ValueError:
        return None  # a line of another format (HAProxy's own notices)


class TrafficLog:
    def __init__(self, socket_path: Path, on_answer: Callable[[Answer], None] | None = None):
        self.socket_path = socket_path
        self.on_answer = on_answer  # told of each answer as it comes (the endpoint's /metrics)
        self._answers: collections.deque[Answer] = collections.deque(maxlen=_MAX_RECORDS)
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        self._thread = threading.Thread(target=self._receive, name="haproxy-log", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while True:
            try:
                data = self._socket.recv(65536)
            except OSError:
                return  # closed by stop()
            answer = parse(data.decode(errors="replace"), time.monotonic())
            if answer is not None:
                with self._lock:
                    self._answers.append(answer)
                if self.on_answer is not None:
                    self.on_answer(answer)

    def since(self, started: float) -> list[Answer]:
        with self._lock:
            return [answer for answer in self._answers if answer.at >= started]

    def stop(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        self.socket_path.unlink(missing_ok=True)


def summarize(answers: list[Answer]) -> dict[str, float | int | None]:
    """Requests, errors (5xx, or no answer at all) and latency percentiles of ``answers``."""
    latencies = np.asarray([answer.active_ms for answer in answers if 0 < answer.status < 500], dtype=float)
    return {
        "requests": len(answers),
        "errors": sum(1 for answer in answers if answer.status >= 500 or answer.status < 0),
        "p50_ms": float(np.percentile(latencies, 50)) if len(latencies) else None,
        "p99_ms": float(np.percentile(latencies, 99)) if len(latencies) else None,
    }


def per_second(answers: list[Answer], since: float) -> dict[int, dict[str, float | int | None]]:
    """``summarize`` for each whole second after ``since`` that holds answers, by its number."""
    seconds: dict[int, list[Answer]] = {}
    for answer in answers:
        seconds.setdefault(int(answer.at - since), []).append(answer)
    return {second: summarize(held) for second, held in sorted(seconds.items())}

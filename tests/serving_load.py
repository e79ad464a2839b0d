"""A steady open-loop load on an endpoint, as clients send it: TF Serving REST predict requests of
one example (cycling through those given) at a fixed rate, each on its own connection, whatever
the answers' latency. Each answer's time, status and the version that answered are kept."""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True)
class Answer:
    sent: float  # time.monotonic()
    status: int  # 0: no HTTP answer at all (refused, reset)
    version: str
    seconds: float


class SteadyLoad:
    def __init__(self, port: int, model: str, instances: list, rate_per_second: float = 40.0, threads: int = 16):
        self.port = port
        self.path = f"/v1/models/{model}:predict"
        self.bodies = itertools.cycle([json.dumps({"instances": [instance]}).encode() for instance in instances])
        self.interval = 1.0 / rate_per_second
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(threads)
        self._thread = threading.Thread(target=self._send_steadily, daemon=True)

    def __enter__(self) -> SteadyLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)

    def _send_steadily(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._pool.submit(self._send_one, next(self.bodies))
            next_at += self.interval
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _send_one(self, body: bytes) -> None:
        sent = time.monotonic()
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request("POST", self.path, body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            answer = Answer(sent, response.status, response.getheader("X-Model-Version", ""), time.monotonic() - sent)
        except (OSError, http.client.HTTPException):
            answer = Answer(sent, 0, "", time.monotonic() - sent)
        finally:
            connection.close()
        self.answers.append(answer)  # list.append is atomic

    def failed(self) -> list[Answer]:
        return [answer for answer in self.answers if answer.status != 200]

    def versions_since(self, since: float) -> set[str]:
        return {answer.version for answer in self.answers if answer.sent >= since and answer.status == 200}

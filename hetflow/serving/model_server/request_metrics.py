"""The model server's ``/metrics``: Prometheus counters and a latency histogram of its predictions."""

from __future__ import annotations

import threading

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


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

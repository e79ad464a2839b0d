"""The endpoint's /metrics from HAProxy's log lines: counts by version and code, and a latency
histogram whose buckets hold what each answer's time says."""

from __future__ import annotations

from hetflow.serving.traffic_log import Answer
from hetflow.serving.traffic_metrics import TrafficMetrics


def _series(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def test_answers_are_counted_by_version_and_code_and_timed_in_their_buckets():
    metrics = TrafficMetrics({"m0": "digits", "m0s1": "digits"}.get)
    for backend, server, status, ms in (
        ("m0", "digits-v3-r0", 200, 3.0),  # 3 ms: in le=0.005 and above, not le=0.0025
        ("m0", "digits-v3-r1", 200, 40.0),
        ("m0s1", "digits-v3-r0", 500, 700.0),
        ("m0", "my-model.v2-v12-r0", 200, 12_000.0),  # a name with dashes; over 10 s: +Inf only
        ("m0", "<NOSRV>", 503, 0.0),  # no server took it
        ("m0", "<NOSRV>", -1, 0.0),  # the client went away before any answer
        ("edge", "origin", 200, 1.0),  # the endpoint's own answers are not a model's
    ):
        metrics.observe(Answer(0.0, backend, server, status, ms))
    got = _series(metrics.text())
    v3 = 'model="digits",version="3"'
    assert got[f'hetflow_endpoint_requests_total{{{v3},code="200"}}'] == 2
    assert got[f'hetflow_endpoint_requests_total{{{v3},code="500"}}'] == 1
    assert got['hetflow_endpoint_requests_total{model="my-model.v2",version="12",code="200"}'] == 1
    none = 'model="digits",version="none"'
    assert got[f'hetflow_endpoint_requests_total{{{none},code="503"}}'] == 1
    assert got[f'hetflow_endpoint_requests_total{{{none},code="-1"}}'] == 1
    bucket = "hetflow_endpoint_request_duration_seconds_bucket"
    assert got[f'{bucket}{{{v3},le="0.0025"}}'] == 0
    assert got[f'{bucket}{{{v3},le="0.005"}}'] == 1
    assert got[f'{bucket}{{{v3},le="0.05"}}'] == 2
    assert got[f'{bucket}{{{v3},le="1.0"}}'] == 3 and got[f'{bucket}{{{v3},le="+Inf"}}'] == 3
    assert got[f"hetflow_endpoint_request_duration_seconds_sum{{{v3}}}"] == 0.743
    assert got[f'{bucket}{{model="my-model.v2",version="12",le="10.0"}}'] == 0
    assert got[f'{bucket}{{model="my-model.v2",version="12",le="+Inf"}}'] == 1
    assert got[f"hetflow_endpoint_request_duration_seconds_count{{{none}}}"] == 1  # the 503 was an answer
    assert not any("edge" in key or "origin" in key for key in got)

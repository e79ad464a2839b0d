"""bench/deploy.py's arithmetic on hand-made figures: DEPLOY.md states the JSON's figures and its
verdicts on the aims of #56, and the committed DEPLOY.md is its JSON's; a swap's memory is judged
against old + new + 15%; a rollout record's steps say when all traffic moved."""

from __future__ import annotations

import json
import re
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))  # the bench scripts import each other as top-level modules
import deploy_load  # noqa: E402
import deploy_report  # noqa: E402
import deploy_swaps  # noqa: E402

MIB = 1 << 20


def closed(rps: float) -> dict:
    return {
        "requests_per_second": rps,
        "failed": 0,
        "p50_ms": 4.0,
        "p99_ms": 9.0,
        "busy_cores": {"haproxy": 0.1, "model servers": 0.9, "client": 0.2, "other work": 0.5},
        "concurrency": 8,
        "seconds": 8.0,
    }


def swap(to_all: float, memory: dict) -> dict:
    steps = {"stage": 0.1, "start": 9.0, "warm_and_check": 0.4, "canary_10": 5.0, "canary_50": 2.0, "promote": 3.0}
    latency = {"requests": 10, "failed": 0, "p50_ms": 2.0, "p99_ms": 8.0}
    return {
        "outcome": "promoted",
        "to_all_traffic_seconds": to_all,
        "detect_seconds": 1.0,
        "steps_seconds": steps,
        "latency_by_step": {step: latency for step in ("stage", "start", "warm_and_check", "canary", "promote")},
        "memory": memory,
        "new_first_answers": {"requests": 20, "failed": 0, "p50_ms": 3.0, "p99_ms": 30.0},
        "new_later_answers": latency,
    }


def bad(outcome: str, back: str, shown: float) -> dict:
    latency = {"requests": 50, "failed": 2, "p50_ms": 6.0, "p99_ms": 12.0}
    return {
        "candidate": "9",
        "outcome": outcome,
        "reason": "canary at 10% rolled back: error rate 4.0% (2 of 50 requests), over the limit 1.0%",
        "champion_after": back,
        "previous": "8",
        "canary_answers": 50,
        "canary_failed": 2,
        "first_traffic_to_rollback_s": shown + 1.0,
        "fault_shown_to_rollback_s": shown,
        "canary_latency": latency,
        "stable_latency": latency,
    }


def record() -> dict:
    fits = {"old_mib": 110.0, "new_mib": 105.0, "peak_mib": 220.0, "limit_mib": 247.2, "one_version_after_s": 2.5}
    over = {**fits, "peak_mib": 260.0, "one_version_after_s": 11.0}
    rolled_back = {
        **swap(60.0, {}),
        "new": "6",
        "outcome": "rolled back",
        "reason": "canary at 50% rolled back: p99 latency 12.6 ms over the limit 12.0 ms",
        "latency_by_step": {"start": {"requests": 10, "failed": 0, "p50_ms": 2.0, "p99_ms": 30.0}},  # no canary step
    }
    return {
        "command": ".venv/bin/python bench/deploy.py",
        "results_file": "bench/results/deploy-x.json",
        "date": "2026-12-02T08:00:00+00:00",
        "wall_seconds": 700.0,
        "machine": "2 CPUs",
        "git_at_start": "abc",
        "at_start": {"load_average": [3.1, 2.0, 1.5], "busy_cores": 1.2},
        "capacity": {
            "endpoint": closed(450.0),
            "direct": closed(500.0),
            "endpoint_2_replicas": closed(700.0),
            "endpoint_invocations": closed(440.0),
            "mlflow_invocations": closed(220.0),
        },
        "limits": {"steps": [10, 50, 100], "step_seconds": 2.0, "min_requests": 100},
        "default_step_seconds": 5.0,
        "rate_per_second": 225.0,
        "steady": {"requests": 2000, "failed": 0, "p50_ms": 2.0, "p99_ms": 10.0},
        "during_swaps": {"requests": 9000, "failed": 0, "p50_ms": 2.5, "p99_ms": 14.0},
        "swaps_asked": 20,
        "swaps": [swap(20.0, fits), swap(24.0, fits), swap(28.0, over), swap(40.0, {}), rolled_back],
        "bad_candidates": {"errors": bad("rolled back", "8", 2.5), "slow": bad("promoted", "9", 12.0)},
        "slow_loop": {"iterations": 200, "iteration_ms": 0.02, "base_p50_ms": 2.0},
    }


def test_deploy_md_states_the_json_figures_and_the_verdicts_on_the_aims():
    measured = record()
    measured["summary"] = deploy_report.summarize(measured)
    text = deploy_report.markdown(measured)
    # numpy's linear percentiles of the promoted ones' 20, 24, 28, 40 s: p50 26, p95 28 + 0.85 * 12
    assert "p50 **26.0 s**, p95 **38.2 s** (aim ≤ 30 s: not met)" in text
    assert "**0.9×** (aim ≥ 0.9×: met)" in text  # 450 / 500 req/s
    assert "**1.56×** (aim ≥ 1.6×: not met)" in text  # 700 / 450
    assert "same `/invocations` requests: **2.0×**" in text  # 440 / 220
    assert "**1.4×** (aim ≤ 1.5×: met)" in text  # p99 14 ms during swaps / 10 ms steady
    assert "swaps in a row: **5** (**5 of the 20 asked**), 4 promoted" in text
    assert (
        "  - v6, a healthy version, was rolled back: canary at 50% rolled back: p99 latency 12.6 ms over the limit "
        "12.0 ms; its first 20 answers' p99 30.0 ms" in text
    )
    assert (
        "p99 by rollout step (median over the swaps, ms): stage 8.0, start 8.0, warm_and_check 8.0, canary 8.0" in text
    )
    assert "failed requests during the swaps: **0 of 9000** (aim 0: met)" in text
    assert "start 9.0" in text and "detect 1.0" in text
    assert "first 20 answers to the load: p99 30.0 ms, its later answers in the swap 8.0 ms" in text
    assert "peak within old + new + 15%: **2 of 3 swaps**" in text  # the swap without samples is not judged
    assert "(peak / (old + new) at most 1.21×)" in text  # 260 / 215 MiB
    assert "at most **11.0 s** (aim ≤ 10 s: not met)" in text
    assert "| errors (v9) | rolled back |" in text and "**2.5** (aim ≤ 10: met) | v8 restored |" in text
    assert "**12.0** (aim ≤ 10: not met) | v9 **not restored** |" in text
    assert "shortened from the default 5 s" in text and "load average was 3.1, 2.0, 1.5" in text


def test_a_swaps_memory_is_old_plus_new_and_the_time_until_only_the_new_version_runs():
    sampler = deploy_load.MemorySampler()
    sampler.samples = [
        (9.0, 10 * MIB, {"1": 100 * MIB}),  # before the alias moved at 10 s
        (12.0, 10 * MIB, {"1": 100 * MIB, "2": 120 * MIB}),  # the peak: both versions
        (15.5, 10 * MIB, {"1": 90 * MIB, "2": 105 * MIB}),  # the old one draining
        (16.5, 10 * MIB, {"2": 105 * MIB}),  # 1.5 s after all traffic moved at 15 s
        (21.0, 10 * MIB, {"2": 104 * MIB}),  # alone, after the rollout's record at 20 s
    ]
    figures = deploy_swaps.swap_memory(sampler, moved=10.0, promoted=15.0, done=20.0, old="1", new="2")
    assert figures == {
        "old_mib": 110.0,
        "new_mib": 104.0,
        "peak_mib": 230.0,
        "limit_mib": 246.1,  # (110 + 104) * 1.15
        "one_version_after_s": 1.5,
    }
    assert deploy_swaps.swap_memory(sampler, moved=30.0, promoted=35.0, done=40.0, old="1", new="2") == {}


def test_all_traffic_moves_at_promote_after_every_earlier_step():
    record = {
        "steps": [
            {"step": "stage", "seconds": 0.5},
            {"step": "start", "seconds": 8.0},
            {"step": "warm_and_check", "seconds": 0.5},
            {
                "step": "canary",
                "seconds": 7.5,
                "canary_steps": [{"share": 10, "seconds": 5.0}, {"share": 50, "seconds": 2.5}],
            },
            {"step": "promote", "seconds": 3.0},
        ]
    }
    assert deploy_swaps.all_traffic_at(100.0, record) == 116.5
    assert deploy_swaps.step_seconds(record) == {
        "stage": 0.5,
        "start": 8.0,
        "warm_and_check": 0.5,
        "canary_10": 5.0,
        "canary_50": 2.5,
        "promote": 3.0,
    }


def test_the_committed_deploy_md_is_the_json_it_names_rendered():
    text = (REPO / "bench" / "DEPLOY.md").read_text()
    results = re.search(r"from `(bench/results/deploy-[0-9TZ]+\.json)`", text).group(1)
    assert deploy_report.markdown(json.loads((REPO / results).read_text())) == text

"""bench/DEPLOY.md from the deploy bench's JSON: the summary figures, their aims and verdicts."""

from __future__ import annotations

from deploy_load import percentile

SLOW_FACTOR = 3.0  # the slow candidate's aim: this many times the steady p50
MEMORY_SLACK = 1.15  # a swap's peak memory may pass old + new by this factor
FIRST_ANSWERS = 20  # the new version's first answers, compared with its later ones


def summarize(record: dict) -> dict:
    """The figures DEPLOY.md states, from the record's measurements."""
    capacity, swaps = record["capacity"], record["swaps"]
    rps = {case: figures["requests_per_second"] for case, figures in capacity.items()}
    to_all = [swap["to_all_traffic_seconds"] for swap in swaps if swap["outcome"] == "promoted"]
    memory = [swap["memory"] for swap in swaps if swap["memory"]]
    promoted = [swap for swap in swaps if swap["outcome"] == "promoted"]
    steps = sorted({step for swap in promoted for step in swap["steps_seconds"]}, key=STEP_ORDER.index)
    return {
        "swaps": len(swaps),
        "promoted": len(to_all),
        "failed_during_swaps": record["during_swaps"]["failed"],
        "requests_during_swaps": record["during_swaps"]["requests"],
        "p99_ratio": _ratio(record["during_swaps"]["p99_ms"], record["steady"]["p99_ms"]),
        "to_all_traffic_p50_s": percentile(to_all, 50),
        "to_all_traffic_p95_s": percentile(to_all, 95),
        "step_median_s": {
            "detect": percentile([swap["detect_seconds"] for swap in promoted], 50),
            **{step: percentile([swap["steps_seconds"][step] for swap in promoted], 50) for step in steps},
        },
        "step_p99_median_ms": {
            step: percentile(
                [
                    swap["latency_by_step"][step]["p99_ms"]
                    for swap in swaps
                    if swap["latency_by_step"].get(step, {}).get("p99_ms")
                ],
                50,
            )
            for step in ("stage", "start", "warm_and_check", "canary", "promote")
        },
        "first_answers_p99_median_ms": percentile(_figure(swaps, "new_first_answers", "p99_ms"), 50),
        "later_answers_p99_median_ms": percentile(_figure(swaps, "new_later_answers", "p99_ms"), 50),
        "memory_within_limit": sum(entry["peak_mib"] <= entry["limit_mib"] for entry in memory),
        "memory_swaps": len(memory),
        "memory_peak_over_old_plus_new_max": max(
            (_ratio(entry["peak_mib"], entry["limit_mib"] / MEMORY_SLACK) for entry in memory), default=None
        ),
        "one_version_after_max_s": max((entry["one_version_after_s"] or 1e9 for entry in memory), default=None),
        "endpoint_over_direct": _ratio(rps["endpoint"], rps["direct"]),
        "two_replicas_over_one": _ratio(rps["endpoint_2_replicas"], rps["endpoint"]),
        "endpoint_over_mlflow": _ratio(rps["endpoint_invocations"], rps["mlflow_invocations"]),
    }


STEP_ORDER = ["stage", "start", "warm_and_check", "canary_10", "canary_50", "canary", "promote", "roll_back"]


def _figure(swaps: list[dict], figures: str, key: str) -> list[float]:
    return [swap[figures][key] for swap in swaps if swap.get(figures, {}).get(key) is not None]


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 2) if numerator is not None and denominator else None


def _verdict(value: float | None, aim: float, at_least: bool = False) -> str:
    if value is None:
        return "not measured"
    return "met" if (value >= aim if at_least else value <= aim) else "not met"


def _cores(figures: dict) -> str:
    cores = figures["busy_cores"]
    shown = ", ".join(f"{side} {value:.2f}" for side, value in cores.items())
    return f"{shown} (sum {sum(cores.values()):.2f} cores)"


def markdown(record: dict) -> str:
    summary, capacity = record["summary"], record["capacity"]
    limits = record["limits"]
    lines = [
        "# Deployment: the endpoint of `hetflow serve` (#56)",
        "",
        f"Written by `{record['command']}` from `{record['results_file']}`, {record['date']}, "
        f"{record['wall_seconds']:.0f} s; {record['machine']}; git {record['git_at_start']}.",
        f"**Shared machine**: other helpers' work ran beside the bench. At its start the load average was "
        f"{', '.join(map(str, record['at_start']['load_average']))} and {record['at_start']['busy_cores']:.2f} "
        "cores were busy before it started anything: every figure below is from a machine the bench did not "
        "have to itself.",
        "",
        "Loopback only: clients → HAProxy on 127.0.0.1 → sandboxed model servers on Unix sockets, the real store "
        "(SQLite), one request = one instance of 8×8×1 uint8, a new connection per request.",
        "",
        *_capacity_lines(record, capacity),
        "",
        *_swap_lines(record, summary, limits),
        "",
        *_bad_candidate_lines(record),
        "",
        *_memory_lines(record, summary),
        "",
    ]
    return "\n".join(lines)


def _capacity_lines(record: dict, capacity: dict) -> list[str]:
    summary = record["summary"]
    rows = [
        ("endpoint, 1 replica (`:predict`)", "endpoint"),
        ("model server called directly (its Unix socket)", "direct"),
        ("endpoint, 2 replicas", "endpoint_2_replicas"),
        ("endpoint, 1 replica (`/invocations`)", "endpoint_invocations"),
        ("`mlflow models serve` alone (`/invocations`)", "mlflow_invocations"),
    ]
    lines = [
        "## Capacity (closed loop)",
        "",
        f"{capacity['endpoint']['concurrency']} requests in flight (2 client processes × 4 threads), "
        f"{capacity['endpoint']['seconds']:.0f} s each.",
        "",
        "| case | req/s | p50 ms | p99 ms | failed | cores busy |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for label, key in rows:
        figures = capacity[key]
        lines.append(
            f"| {label} | {figures['requests_per_second']:.1f} | {figures['p50_ms']} | {figures['p99_ms']} | "
            f"{figures['failed']} | {_cores(figures)} |"
        )
    lines += [
        "",
        f"- endpoint vs one model server called directly: **{summary['endpoint_over_direct']}×** "
        f"(aim ≥ 0.9×: {_verdict(summary['endpoint_over_direct'], 0.9, True)})",
        f"- 2 replicas vs 1 on 2 cores: **{summary['two_replicas_over_one']}×** "
        f"(aim ≥ 1.6×: {_verdict(summary['two_replicas_over_one'], 1.6, True)})",
        f"- endpoint vs `mlflow models serve` alone, same version, same `/invocations` requests: "
        f"**{summary['endpoint_over_mlflow']}×**",
        "- what bounds them: the cores column, each side's CPU seconds per second of the run (client: the load "
        "processes; mlflow: its scoring server; other work: the machine's busy cores, /proc/stat, less the "
        "bench's). Where the sum nears the machine's 2 cores, the cores bound the case; one replica is one Python "
        "process (its HTTP handling under one GIL), so its model servers' figure shows how near one core it ran.",
    ]
    return lines


def _swap_lines(record: dict, summary: dict, limits: dict) -> list[str]:
    steady, during = record["steady"], record["during_swaps"]
    shortened = limits["step_seconds"] != record["default_step_seconds"]
    step_note = (
        f"each canary step lasting at least **{limits['step_seconds']:g} s, shortened from the default "
        f"{record['default_step_seconds']:g} s** to fit the bench's time"
        if shortened
        else f"each canary step at least the default {limits['step_seconds']:g} s"
    )
    medians = summary["step_median_s"]
    fewer = (
        f" (**{summary['swaps']} of the {record['swaps_asked']} asked**)"
        if summary["swaps"] < record["swaps_asked"]
        else ""
    )
    return [
        "## Champion swaps under a steady load",
        "",
        f"Open loop at {record['rate_per_second']:.1f} req/s (half the endpoint's closed-loop capacity), "
        f"canary steps {'→'.join(map(str, limits['steps']))}%, {step_note}, at least {limits['min_requests']} "
        "canary answers per step.",
        "",
        f"- swaps in a row: **{summary['swaps']}**{fewer}, {summary['promoted']} promoted",
        *(
            f"  - v{swap['new']}, a healthy version, was {swap['outcome']}: {swap['reason']}; its first "
            f"{FIRST_ANSWERS} answers' p99 {swap.get('new_first_answers', {}).get('p99_ms')} ms"
            for swap in record["swaps"]
            if swap["outcome"] != "promoted"
        ),
        f"- failed requests during the swaps: **{summary['failed_during_swaps']} of "
        f"{summary['requests_during_swaps']}** (aim 0: {_verdict(summary['failed_during_swaps'], 0)})",
        f"- p99 during swaps {during['p99_ms']} ms vs steady {steady['p99_ms']} ms (p50 {during['p50_ms']} vs "
        f"{steady['p50_ms']} ms): **{summary['p99_ratio']}×** (aim ≤ 1.5×: {_verdict(summary['p99_ratio'], 1.5)}); "
        f"steady: the {steady['requests']} answers outside the swaps (the load's first seconds, p99 "
        f"{record.get('first_seconds', {}).get('p99_ms')} ms, and the pauses between swaps)",
        "- p99 by rollout step (median over the swaps, ms): "
        + ", ".join(f"{step} {value}" for step, value in summary["step_p99_median_ms"].items()),
        f"- alias moved → all traffic on the new version: p50 **{summary['to_all_traffic_p50_s']} s**, p95 "
        f"**{summary['to_all_traffic_p95_s']} s** (aim ≤ 30 s: {_verdict(summary['to_all_traffic_p95_s'], 30)})",
        f"- the new version's first {FIRST_ANSWERS} answers to the load: p99 {summary['first_answers_p99_median_ms']} "
        f"ms, its later answers in the swap {summary['later_answers_p99_median_ms']} ms (medians over the swaps)",
        "- where the time goes (median seconds over the promoted swaps; detect: the follower's poll of the alias, "
        "every 2 s): " + ", ".join(f"{step} {value}" for step, value in medians.items()),
    ]


def _bad_candidate_lines(record: dict) -> list[str]:
    slow_loop = record["slow_loop"]
    lines = [
        "## Bad candidates",
        "",
        f"Under the same load. *errors*: a model failing (500) on the 5% of inputs whose pixel sum is a multiple "
        f"of 20; *slow*: a loop of {slow_loop['iterations']} dense layers before answering, sized to add "
        f"{SLOW_FACTOR - 1:g}× the steady p50 ({slow_loop['base_p50_ms']} ms; {slow_loop['iteration_ms']} ms an "
        "iteration, timed here).",
        "",
        "| candidate | outcome | canary answers (failed) | canary p50 / stable p50 ms | first traffic → "
        "rollback s | fault shown → rollback s | champion after | reason |",
        "|---|---|---:|---|---:|---:|---|---|",
    ]
    for kind, figures in record["bad_candidates"].items():
        restored = "restored" if figures["champion_after"] == figures["previous"] else "**not restored**"
        lines.append(
            f"| {kind} (v{figures['candidate']}) | {figures['outcome']} | {figures['canary_answers']} "
            f"({figures['canary_failed']}) | {figures['canary_latency']['p50_ms']} / "
            f"{figures['stable_latency']['p50_ms']} | {figures['first_traffic_to_rollback_s']} | "
            f"**{figures['fault_shown_to_rollback_s']}** (aim ≤ 10: "
            f"{_verdict(figures['fault_shown_to_rollback_s'], 10)}) | v{figures['champion_after']} {restored} | "
            f"{figures['reason']} |"
        )
    return lines


def _memory_lines(record: dict, summary: dict) -> list[str]:
    peaks = [swap["memory"] for swap in record["swaps"] if swap["memory"]]
    shown = "; ".join(f"{entry['peak_mib']:.0f} of {entry['limit_mib']:.0f}" for entry in peaks[:5])
    return [
        "## Memory during a swap",
        "",
        "RSS of the endpoint's processes (HAProxy and the model servers), sampled every 0.2 s. old: HAProxy and the "
        "old version before the alias moved; new: the new version's servers once alone.",
        "",
        f"- peak within old + new + 15%: **{summary['memory_within_limit']} of {summary['memory_swaps']} swaps** "
        f"(peak / (old + new) at most {summary['memory_peak_over_old_plus_new_max']}×); the first swaps' peak "
        f"and limit, MiB: {shown}",
        f"- back to one version's servers after all traffic moved: at most **{summary['one_version_after_max_s']} s**"
        f" (aim ≤ 10 s: {_verdict(summary['one_version_after_max_s'], 10)})",
    ]

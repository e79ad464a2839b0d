"""What bench/run.py holds its cases' results to: the same bytes exchanged over a loopback socket
(bench/socket_bound.py), the peer's case, and the two-core ceiling, with the aims for each ratio."""

from __future__ import annotations

import json
import statistics
import subprocess
from typing import Any

from throughput_cases import BIN, REPO_ROOT, RunFailed

# Ours against the peer: (our case, the peer's case), and the aims for the two ratios.
PEER_PAIR = ("mwms_2", "ray_2w")
AIM_EXAMPLES_RATIO = 1.2  # ours / Ray's whole-job examples/s, at least
AIM_FIRST_STEP_RATIO = 0.5  # ours / Ray's time to first step, at most
# Two synchronous workers against the same two workers with nothing to exchange.
CEILING_PAIR = ("mwms_2", "two_apart")
AIM_CEILING_SHARE = 0.9  # of the ceiling's whole-command examples/s, at least
# The case whose all-reduce is held to the bound of the same bytes summed over a socket.
BOUND_CASE = "mwms_2"
AIM_BOUND_RATIO = 3.0  # the case's collective seconds per step / the bound's, at most
# The asynchronous case, held against the same ceiling and its exchange against the same kind of
# bound (no aim of its own: the sync aims are shown beside it).
PS_CASE = "ps_2w_1ps"


def socket_bound(size: int, pattern: str) -> dict[str, Any]:
    """bench/socket_bound.py's exchange of ``size`` bytes in ``pattern`` between two pinned processes."""
    command = [str(BIN / "python"), "bench/socket_bound.py", f"--bytes={size}", f"--pattern={pattern}"]
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise RunFailed("socket_bound: no result after 120 s") from None
    if done.returncode != 0:
        raise RunFailed(f"socket_bound: exit code {done.returncode}; last output:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_seconds(runs: list[dict]) -> float | None:
    """The median time of a step after the first (traced) one, over a case's runs."""
    if not runs:
        return None
    return statistics.median(
        run["steps_seconds"] / (run["record"]["steps_per_epoch"] * len(run["record"]["epoch_seconds"]) - 1)
        for run in runs
    )


def against_bound(
    samples: dict[str, list[dict]], case: str, field: str, size_key: str, pattern: str, kept: tuple[str, ...]
) -> dict[str, Any] | None:
    """``case``'s ``field`` of training.json, its seconds per step (median of its runs), against
    ``socket_bound`` of the record's ``size_key`` bytes in ``pattern``, with the record's ``kept``
    keys, when the case ran and recorded it."""
    runs = [s["record"][field] for s in samples.get(case, []) if field in s["record"]]
    if not runs:
        return None
    seconds = statistics.median(run["seconds_per_step"] for run in runs)
    bound = socket_bound(runs[0][size_key], pattern)
    return {
        "case": case,
        "seconds_per_step": seconds,
        "samples": [run["seconds_per_step"] for run in runs],
        **{key: runs[0][key] for key in kept},
        "bound": bound,
        "ratio_to_bound": seconds / bound["seconds"],
    }


def collectives_against_bound(samples: dict[str, list[dict]]) -> dict[str, Any] | None:
    """BOUND_CASE's collectives against the same bytes all-reduced over a socket; beside them, what
    a step of the case took more than a step of the ceiling's (the same workers without an
    all-reduce), where that ran: the all-reduce as the steps pay it."""
    kept = ("bytes_per_step", "collectives_per_step", "dtypes", "implementation", "bytes_per_pack")
    measured = against_bound(samples, BOUND_CASE, "collectives", "bytes_per_step", "all_reduce", kept)
    if measured is None:
        return None
    return {
        **measured,
        "aim": f"<= {AIM_BOUND_RATIO}",
        "step_seconds": step_seconds(samples[BOUND_CASE]),
        "ceiling_step_seconds": step_seconds(samples.get(CEILING_PAIR[1], [])),
    }


def ps_communication_against_bound(samples: dict[str, list[dict]]) -> dict[str, Any] | None:
    """PS_CASE's exchange with the ps against the same bytes sent there and back over a socket."""
    kept = ("bytes_to_worker", "bytes_to_ps", "variables", "measured")
    return against_bound(samples, PS_CASE, "communication", "bytes_to_worker", "round_trip", kept)


def peer_comparison(cases: dict[str, Any]) -> dict[str, Any] | None:
    """Ours against the peer from the medians, when both ran: whole-job examples/s and time to
    first step, ours / Ray's, with the aims they are held to."""
    ours, peer = (cases.get(name, {}).get("median") for name in PEER_PAIR)
    if not ours or not peer:
        return None

    def ratio(key: str) -> float:
        return ours[key] / peer[key]

    return {
        "ours": PEER_PAIR[0],
        "peer": PEER_PAIR[1],
        "whole_job_examples_per_second_ratio": ratio("whole_job_examples_per_second"),
        "whole_job_examples_per_second_aim": f">= {AIM_EXAMPLES_RATIO}",
        "time_to_first_step_ratio": ratio("time_to_first_step_seconds"),
        "time_to_first_step_aim": f"<= {AIM_FIRST_STEP_RATIO}",
    }


def ceiling_comparison(cases: dict[str, Any], case: str) -> dict[str, Any] | None:
    """``case`` against two_apart, the same two single-threaded workers without communication, each
    as a multiple of one_worker (medians of whole-command examples/s), when all three ran; and the
    same over the whole job."""
    ours, apart = cases.get(case, {}), cases.get(CEILING_PAIR[1], {})
    if ours.get("ratio_to_one_worker") is None or apart.get("ratio_to_one_worker") is None:
        return None
    return {
        "case": case,
        "ceiling": CEILING_PAIR[1],
        "case_vs_one_worker": ours["ratio_to_one_worker"],
        "ceiling_vs_one_worker": apart["ratio_to_one_worker"],
        "case_vs_ceiling": ours["ratio_to_one_worker"] / apart["ratio_to_one_worker"],
        "whole_job_case_vs_ceiling": ours["whole_job_ratio_to_one_worker"] / apart["whole_job_ratio_to_one_worker"],
    }

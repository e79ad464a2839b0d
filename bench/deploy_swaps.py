"""The deploy bench's champion swaps and bad candidates: one alias move each, under the steady load,
timed from the rollout's record and sampled memory (bench/deploy.py runs them)."""

from __future__ import annotations

import time
from pathlib import Path

from deploy_load import MODEL, MemorySampler, latency_figures
from deploy_report import FIRST_ANSWERS, MEMORY_SLACK

ROLLOUT_DEADLINE_SECONDS = 120.0
SETTLE_SECONDS = 1.5  # between swaps


def wait_for_rollout(endpoint, count: int) -> tuple[float, dict]:
    """The ``count``-th rollout's start and record, once written."""
    deadline = time.monotonic() + ROLLOUT_DEADLINE_SECONDS
    while len(endpoint.rollouts) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"rollout {count} did not finish within {ROLLOUT_DEADLINE_SECONDS:.0f} s")
        time.sleep(0.1)
    return endpoint.rollouts[count - 1]


def step_seconds(record: dict) -> dict:
    """Each step's seconds, the canary's split into its traffic steps (``canary_10`` ...)."""
    seconds = {}
    for step in record["steps"]:
        if step["step"] == "canary":
            for judged in step["canary_steps"]:
                seconds[f"canary_{judged['share']}"] = judged["seconds"]
        else:
            seconds[step["step"]] = step["seconds"]
    return seconds


def all_traffic_at(began: float, record: dict) -> float:
    """When the new version took all traffic: promote's first act, after every step before it."""
    return began + sum(step["seconds"] for step in record["steps"] if step["step"] != "promote")


def swap_memory(memory: MemorySampler, moved: float, promoted: float, done: float, old: str, new: str) -> dict:
    """Around one swap: the endpoint's RSS before (HAProxy and the old version), the new version's
    once alone, the peak during the swap, and how long after all traffic moved only the new
    version's servers were left."""
    mib = 1 << 20
    before = [s for s in memory.between(moved - 2.0, moved) if old in s[2]]
    after = [s for s in memory.between(done, done + SETTLE_SECONDS) if set(s[2]) == {new}]
    during = memory.between(moved, done)
    if not (before and after and during):
        return {}
    old_total = before[-1][1] + before[-1][2][old]
    new_alone = after[0][2][new]
    peak = max(s[1] + sum(s[2].values()) for s in during)
    one_version = next((s[0] for s in memory.between(promoted, done + 10.0) if set(s[2]) == {new}), None)
    return {
        "old_mib": round(old_total / mib, 1),
        "new_mib": round(new_alone / mib, 1),
        "peak_mib": round(peak / mib, 1),
        "limit_mib": round((old_total + new_alone) * MEMORY_SLACK / mib, 1),
        "one_version_after_s": None if one_version is None else round(one_version - promoted, 2),
    }


def move_champion(endpoint, registry, folder: Path) -> tuple:
    """A new version from ``folder`` made champion, as a reviewer does; once the endpoint has
    recorded its rollout: the champion before, the new version, when the
    alias moved, when the rollout began, its record, when it was done (monotonic times)."""
    from serving_models import register

    client = registry["client"]
    before = str(client.get_registered_model(MODEL).aliases["champion"])
    version = register(client, MODEL, folder)
    count = len(endpoint.rollouts) + 1  # the endpoint's rollouts are one at a time, in order
    moved = time.monotonic()
    client.set_registered_model_alias(MODEL, "champion", version)
    began, record = wait_for_rollout(endpoint, count)
    return before, version, moved, began, record, time.monotonic()


def swap_once(endpoint, registry, load, memory, folder: Path) -> dict:
    """Register a version from ``folder``, move champion to it, wait for its rollout; its figures."""
    old, new, moved, began, record, done = move_champion(endpoint, registry, folder)
    time.sleep(SETTLE_SECONDS)  # the new version alone, its memory sampled
    promoted = all_traffic_at(began, record)
    answers = [answer for answer in load.answers if moved <= answer.sent < done]
    phases = {}
    at = began
    for step in record["steps"]:
        window = [answer for answer in answers if at <= answer.sent < at + step["seconds"]]
        phases[step["step"]] = latency_figures(window)
        at += step["seconds"]
    fresh = sorted((a for a in answers if a.version == new and a.status == 200), key=lambda a: a.sent)
    return {
        "old": old,
        "new": new,
        # a fresh model server's first answers to the load (its warm-up sent the input example's 5 rows, the
        # load sends 1) against its later ones in the same swap
        "new_first_answers": latency_figures(fresh[:FIRST_ANSWERS]),
        "new_later_answers": latency_figures(fresh[FIRST_ANSWERS:]),
        "outcome": record.get("outcome"),
        "reason": record.get("reason"),
        "detect_seconds": round(began - moved, 2),
        "steps_seconds": step_seconds(record),
        "to_all_traffic_seconds": round(promoted - moved, 2),
        "seconds_to_recorded": round(done - moved, 2),
        "latency": latency_figures(answers),
        "latency_by_step": phases,
        "memory": swap_memory(memory, moved, promoted, done, old, new),
    }


def bad_candidate(endpoint, registry, load, folder: Path) -> dict:
    """A faulty version made champion under the load: how soon after its canary's first answer, and
    after the fault showed (its first failed answer, or its first slow one), traffic went back;
    whether ``champion`` came back; the canary's and the stable version's latency meanwhile."""
    previous, candidate, moved, began, record, done = move_champion(endpoint, registry, folder)
    client = registry["client"]
    answers = [answer for answer in load.answers if moved <= answer.sent < done]
    canary = sorted((a for a in answers if a.version == candidate), key=lambda a: a.sent)
    back = next((step for step in record["steps"] if step["step"] == "roll_back"), None)
    traffic_back = began + record["seconds"] - back["seconds"] if back else None
    failed = [a for a in canary if a.status != 200]
    shown = (failed or canary)[0] if canary else None  # a slow answer shows its fault as it arrives
    stable = [a for a in answers if a.version == previous and canary and a.sent >= canary[0].sent]
    return {
        "candidate": candidate,
        "outcome": record.get("outcome"),
        "reason": record.get("reason"),
        "champion_after": str(client.get_registered_model(MODEL).aliases["champion"]),
        "previous": previous,
        "canary_answers": len(canary),
        "canary_failed": len(failed),
        "failed_of_other_versions": sum(a.status != 200 for a in answers if a.version != candidate),
        "first_traffic_to_rollback_s": round(traffic_back - canary[0].sent, 2) if canary and back else None,
        "fault_shown_to_rollback_s": round(traffic_back - shown.sent - shown.seconds, 2) if shown and back else None,
        "canary_latency": latency_figures(canary),
        "stable_latency": latency_figures(stable),
        "steps_seconds": step_seconds(record),
        "roll_back_seconds": back["seconds"] if back else None,
    }

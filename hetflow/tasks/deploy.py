"""deploy: one step of the running endpoint's rollout, as a task of the ``hetflow_deploy`` DAG.

The endpoint (``hetflow serve``) carries out the rollout; each task of the DAG waits, through the
endpoint's control socket (``hetflow.serving.control``), for the rollout to pass its step, and logs
that step's figures: Airflow's grid shows where a rollout stopped, and each task's log what its step
measured. A step the rollout failed fails its task with the reason as one line.

What to deploy comes from the run's conf (a run triggered by hand: ``{"model": ..., "version": ...}``)
or else from the Asset events ``register`` emitted as it moved ``champion`` (one per model moved).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hetflow.serving import control

log = logging.getLogger("hetflow.stages")

STEPS = ("stage", "start", "warm_and_check", "canary", "promote")
POLL_SECONDS = 0.5
# A step waited for longer than this fails its task: the canary's steps last up to 30 s each by default.
STEP_DEADLINE_SECONDS = 600.0


class RolloutStopped(RuntimeError):
    """The rollout did not pass this step: the message is the reason, one line."""


def targets(conf: dict[str, Any], events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(model, version) for each thing to deploy: the conf's, else each event's; one line naming the
    field and what it allows where one is wrong."""
    requested = [conf] if conf else events
    if not requested:
        raise control.BadRequest(
            'nothing to deploy: trigger with conf {"model": NAME, "version": N}, or let register move champion'
        )
    found = []
    for value in requested:
        target = control.parse_target(value)
        if target not in found:
            found.append(target)
    return found


def deploy(run_id: str, step: str, conf: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """Wait until the endpoint's rollout of every target has passed ``step``; log its figures.

    :raises control.NoEndpoint: no endpoint runs (the DAG skips its first task on it)
    :raises RolloutStopped: the rollout failed this step, or ended before it
    """
    if step not in STEPS:
        raise ValueError(f"step {step!r}: one of {', '.join(STEPS)}")
    done = {}
    for model, version in targets(conf, events):
        entry = _wait_for(model, version, step)
        for line in figure_lines(step, entry):
            log.info("%s v%s %s", model, version, line)
        done[f"{model} v{version}"] = entry
    return {"run_id": run_id, "step": step, "rollouts": done}


def _wait_for(model: str, version: str, step: str) -> dict[str, Any]:
    """The rollout's record of ``step`` once it passed it; RolloutStopped once the rollout ended
    without passing it (after its rollback, so champion is back when the task fails)."""
    deadline = time.monotonic() + STEP_DEADLINE_SECONDS
    while time.monotonic() < deadline:
        answer = control.ask(model, version)
        state, record = answer["state"], answer.get("record", {})
        if state in ("refused", "bad request", "error"):
            raise RolloutStopped(f"the endpoint will not deploy {model} v{version}: {answer['reason']}")
        entry = next((s for s in record.get("steps", []) if s["step"] == step), None)
        if entry is not None and not entry.get("failed"):
            return entry
        if state == "promoted":  # a first version is served without a canary
            return {"step": step, "skipped": "the endpoint served nothing of this model before: no canary"}
        if state == "rolled back":
            raise RolloutStopped(f"{model} v{version} rolled back at {_failed_step(record)}: {record['reason']}")
        time.sleep(POLL_SECONDS)
    raise RolloutStopped(f"{model} v{version} did not pass {step} within {STEP_DEADLINE_SECONDS:.0f} s")


def _failed_step(record: dict[str, Any]) -> str:
    return next((s["step"] for s in record["steps"] if s.get("failed")), "its start")


def figure_lines(step: str, entry: dict[str, Any]) -> list[str]:
    """The step's figures as the task log shows them."""
    if "skipped" in entry:
        return [f"{step}: {entry['skipped']}"]
    head = f"{step}: done in {entry['seconds']:.1f} s"
    if step != "canary":
        details = ", ".join(
            f"{key.replace('_', ' ')} {value}" for key, value in entry.items() if key not in ("step", "seconds")
        )
        return [f"{head}{': ' + details if details else ''}"]
    return [head] + [
        f"canary at {judged['share']}% for {judged['seconds']:.1f} s: {judged['canary_requests']} requests, "
        f"error rate {judged['canary_error_rate']:.2%}, p99 {_ms(judged['canary_p99_ms'])} "
        f"(stable {_ms(judged['stable_p99_ms'])}){'; ' + judged['note'] if judged.get('note') else ''}"
        for judged in entry.get("canary_steps", [])
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"

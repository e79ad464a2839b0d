"""One rollout: a model's endpoint moving from the version it serves to the version ``champion``
now names, in the steps TF Serving, KServe and Argo Rollouts take, each a method:

    stage ──► start ──► warm_and_check ──► canary (steps of the traffic) ──► promote
      │         │              │                      │
      └─────────┴──────────────┴──────────────────────┴──► roll_back: traffic back, champion back

A version that does not stage, start or pass its check never takes traffic. A canary step judged
bad by ``policy.decide`` rolls back at once. The record (``self.record``) says what each step did,
with its figures and seconds; the endpoint writes it on the version and as a run in MLflow.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetflow.serving import policy, traffic_log
from hetflow.serving.server import ServingError

log = logging.getLogger("hetflow.serving")

WARM_REQUESTS = 20  # per replica, before it takes any traffic
DRAIN_DEADLINE_SECONDS = 30.0
POLL_SECONDS = 0.5


class RolloutFailed(RuntimeError):
    """The candidate never took traffic, or was rolled back: the message is the reason, one line."""


@dataclass
class Rollout:
    endpoint: Any  # hetflow.serving.endpoint.Endpoint: its balancer, traffic log, versions and client
    model: str
    version: str
    previous: str | None
    limits: policy.Limits = field(default_factory=policy.Limits)
    record: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.record.update(model=self.model, version=self.version, previous=self.previous, steps=[])
        self.servers = None
        self.started: float | None = None  # time.monotonic() as run() began

    def run(self) -> dict[str, Any]:
        """Every step in turn; raises RolloutFailed with the reason once the candidate was rolled back."""
        self.started = started = time.monotonic()
        try:
            for step in (self.stage, self.start, self.warm_and_check):
                self._timed(step.__name__, step)
            if self.previous is not None:
                self._timed("canary", self.canary)
            self._timed("promote", self.promote)
        except RolloutFailed as failure:
            reason = str(failure)
            self._timed("roll_back", lambda: self.roll_back(reason))
            raise
        finally:
            self.record["seconds"] = round(time.monotonic() - started, 2)
        self.record["outcome"] = "promoted"
        return self.record

    def _timed(self, name: str, step) -> None:
        began = time.monotonic()
        try:
            details = step() or {}
        except RolloutFailed:  # its time is recorded too: a canary's until the rollback
            self.record["steps"].append({"step": name, "seconds": round(time.monotonic() - began, 2), "failed": True})
            raise
        self.record["steps"].append({"step": name, "seconds": round(time.monotonic() - began, 2), **details})
        log.info("rollout %s v%s: %s done in %.1f s", self.model, self.version, name, time.monotonic() - began)

    def stage(self) -> dict[str, Any]:
        """The version's files, copied and checked; nothing of them is loaded here."""
        self.servers = self.endpoint.version_servers(self.model, self.version)
        try:
            files = self.servers.stage()
        except Exception as error:
            raise RolloutFailed(f"version {self.version} could not be staged: {_one_line(error)}") from error
        return {"files": len(files), "bytes": sum(entry["bytes"] for entry in files.values())}

    def start(self) -> dict[str, Any]:
        try:
            self.servers.start(time.monotonic() + self.endpoint.start_deadline_seconds)
        except Exception as error:
            raise RolloutFailed(f"version {self.version} did not start: {_one_line(error)}") from error
        return {"replicas": len(self.servers.sockets)}

    def warm_and_check(self) -> dict[str, Any]:
        """The input example MLflow recorded with the version sent ``WARM_REQUESTS`` times to every
        replica before any traffic reaches it; every replica must answer it alike, with finite logits
        of one row per example. Then the balancer holds the version, at no share of the traffic yet
        (reachable at /versions/N)."""
        try:
            example = self.servers.input_example()
            answers = []
            for replica in range(len(self.servers.sockets)):
                for _ in range(WARM_REQUESTS):
                    answer = self.servers.predict(example, replica=replica)
                answers.append(answer)
        except ServingError as error:
            raise RolloutFailed(f"version {self.version} failed its warm-up: {_one_line(error)}") from error
        first = answers[0]
        if first.shape[0] != len(example) or not np.all(np.isfinite(first)):
            raise RolloutFailed(
                f"version {self.version} answered its {len(example)} input examples with {first.shape} values, "
                "not finite logits per example"
            )
        if any(not np.allclose(answer, first, atol=1e-5) for answer in answers[1:]):
            raise RolloutFailed(f"version {self.version}'s replicas answered the same input differently")
        self.endpoint.balancer.set_version_servers(self.model, int(self.version), self.servers.sockets)
        return {"warm_requests": WARM_REQUESTS * len(answers)}

    def canary(self) -> dict[str, Any]:
        """The canary's share of traffic in ``limits.steps`` (the last, 100, is the promotion), each
        step judged by ``policy.decide``."""
        judged = []
        stable_figures = policy.VersionFigures()
        self.endpoint.balancer.set_label(self.model, "canary", int(self.version))
        for share in self.limits.steps[:-1]:
            self.endpoint.balancer.set_weights(self.model, {int(self.previous): 100 - share, int(self.version): share})
            figures, stable_figures = self._judge_step(share, stable_figures)
            judged.append(figures)
        return {"canary_steps": judged}

    def _judge_step(self, share: int, last_stable: policy.VersionFigures):
        began, breaches = time.monotonic(), 0
        while True:
            time.sleep(POLL_SECONDS)
            canary, stable = (self._figures(version, began) for version in (self.version, self.previous))
            if stable.p99_ms is None:  # the stable version had no answer in this window yet
                stable = last_stable
            figures = policy.StepFigures(canary, stable, time.monotonic() - began, p99_breaches=breaches)
            decision = policy.decide(figures, self.limits)
            breaches = breaches + 1 if decision.figures.get("p99_over_limit") else 0
            if decision.action == "roll_back":
                self.record["canary_steps_failed"] = {"share": share, **decision.figures}
                raise RolloutFailed(f"canary at {share}% rolled back: {decision.reason}")
            if decision.action == "advance":
                judged = {"share": share, "seconds": round(time.monotonic() - began, 2), **decision.figures}
                return {**judged, **({"note": decision.reason} if decision.reason else {})}, stable

    def _figures(self, version: str, since: float) -> policy.VersionFigures:
        summary = traffic_log.summarize(self.endpoint.answers_of(self.model, version, since))
        return policy.VersionFigures(summary["requests"], summary["errors"], summary["p99_ms"])

    def promote(self) -> dict[str, Any]:
        """All traffic to the new version; the old one drains (requests in flight finish) and stops."""
        balancer, version = self.endpoint.balancer, int(self.version)
        balancer.set_weights(self.model, {version: 100, **({int(self.previous): 0} if self.previous else {})})
        balancer.set_label(self.model, "stable", version)
        balancer.set_version_state(self.model, version, "AVAILABLE")
        replaced = self.endpoint.serving_now(self.model, self.version, self.servers)
        if replaced is None:
            return {}
        began = time.monotonic()
        balancer.remove_version(self.model, int(self.previous), timeout_s=DRAIN_DEADLINE_SECONDS)
        replaced.stop()
        return {"drain_seconds": round(time.monotonic() - began, 2)}

    def roll_back(self, reason: str) -> dict[str, Any]:
        """Traffic back to the previous version, the candidate drained and stopped, ``champion`` moved
        back, the reason on the candidate."""
        self.record.update(outcome="rolled back", reason=reason)
        balancer = self.endpoint.balancer
        if self.previous is not None and self.endpoint.holds(self.model, self.previous):
            balancer.set_weights(self.model, {int(self.previous): 100, int(self.version): 0})
            balancer.set_label(self.model, "stable", int(self.previous))
        if self.endpoint.holds(self.model, self.version):
            balancer.remove_version(self.model, int(self.version), timeout_s=DRAIN_DEADLINE_SECONDS)
        if self.servers is not None:
            self.servers.stop()
        self.endpoint.champion_back(self.model, self.version, self.previous, reason)
        return {}


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__

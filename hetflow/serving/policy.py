"""The rollout's policy: from what the endpoint measured on each version during a canary step to
what the rollout does next. A pure function of its inputs, like ``cluster.supervisor.decide``:
the rollout (``hetflow/serving/rollout.py``) gathers the figures, this decides, and its tests need
no server.

A canary step gives the new version a share of the traffic for at least ``step_seconds`` and
``min_requests`` requests (or, where traffic is too thin for them, ``max_step_seconds``: an idle
endpoint still moves to its new champion, on the evidence there was). It is judged on the
requests it answered in that step, against the version it would replace over the same window:

- error rate (5xx answers and failed connections per request) over ``max_error_rate``;
- p99 latency over ``max_p99_ratio`` times the stable version's (and over ``p99_floor_ms``, so
  that two sub-millisecond p99s differing by noise do not roll back), on ``p99_confirmations``
  polls in a row;
- answers that disagree with the stable version's on mirrored requests, over
  ``max_disagreement``.

Any one of them rolls back at once, without waiting for the step to end: a bad canary costs as
few requests as the evidence needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Limits:
    """When a canary is rolled back, and how long each step lasts. The defaults are stated in
    docs/deploy.md; ``hetflow serve`` takes each as an option."""

    steps: tuple[int, ...] = (10, 50, 100)  # the canary's traffic share, percent, step by step
    step_seconds: float = 5.0
    min_requests: int = 100  # a step is judged on no fewer answers of the canary ...
    max_step_seconds: float = 30.0  # ... unless traffic is too thin for them: then on what came by then
    max_error_rate: float = 0.01
    max_p99_ratio: float = 2.0
    p99_floor_ms: float = 5.0
    # Polls in a row (0.5 s apart) the p99 must stay over its limit: on a busy machine one poll's tail
    # of ~100 answers is a handful of requests, and it rolled back healthy versions (the bench: 8 of 20).
    p99_confirmations: int = 3
    max_disagreement: float = 0.0  # the exported model's answers are checked before; any change is news


@dataclass(frozen=True)
class VersionFigures:
    """One version's answers over one window."""

    requests: int = 0
    errors: int = 0
    p99_ms: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class StepFigures:
    canary: VersionFigures
    stable: VersionFigures
    seconds: float  # since the step began
    mirrored: int = 0  # requests answered by both versions and compared
    disagreed: int = 0
    p99_breaches: int = 0  # the polls just before this one, in a row, whose p99 was over the limit


@dataclass(frozen=True)
class Decision:
    action: str  # "wait": the step goes on; "advance": to the next step (or done after the last); "roll_back"
    reason: str = ""
    figures: dict = field(default_factory=dict)


def decide(step: StepFigures, limits: Limits) -> Decision:
    canary, stable = step.canary, step.stable
    figures = {
        "canary_requests": canary.requests,
        "canary_error_rate": round(canary.error_rate, 4),
        "canary_p99_ms": canary.p99_ms,
        "stable_p99_ms": stable.p99_ms,
        "mirrored": step.mirrored,
        "disagreed": step.disagreed,
    }
    # Before min_requests answers, errors count against min_requests: one early error is not yet a rate.
    if canary.errors > limits.max_error_rate * max(canary.requests, limits.min_requests):
        return Decision(
            "roll_back",
            f"error rate {canary.error_rate:.1%} ({canary.errors} of {canary.requests} requests), "
            f"over the limit {limits.max_error_rate:.1%}",
            figures,
        )
    if step.mirrored and step.disagreed / step.mirrored > limits.max_disagreement:
        return Decision(
            "roll_back",
            f"{step.disagreed} of {step.mirrored} mirrored requests answered differently from the stable version",
            figures,
        )
    p99_limit = _p99_limit(stable, limits)
    if canary.requests >= limits.min_requests and canary.p99_ms is not None and p99_limit is not None:
        if canary.p99_ms > p99_limit:
            if step.p99_breaches + 1 < limits.p99_confirmations:
                return Decision("wait", figures={**figures, "p99_over_limit": True})
            return Decision(
                "roll_back",
                f"p99 latency {canary.p99_ms:.1f} ms over the limit {p99_limit:.1f} ms "
                f"({limits.max_p99_ratio:g}x the stable version's {stable.p99_ms:.1f} ms) "
                f"on {limits.p99_confirmations} polls in a row",
                figures,
            )
    if step.seconds < limits.step_seconds:
        return Decision("wait", figures=figures)
    if canary.requests < limits.min_requests:
        if step.seconds < limits.max_step_seconds:
            return Decision("wait", figures=figures)
        # An endpoint with little or no traffic still moves to its champion, judged on what it saw.
        return Decision("advance", f"only {canary.requests} answers in {step.seconds:.0f} s: judged on those", figures)
    return Decision("advance", figures=figures)


def _p99_limit(stable: VersionFigures, limits: Limits) -> float | None:
    if stable.p99_ms is None:
        return None
    return max(stable.p99_ms * limits.max_p99_ratio, limits.p99_floor_ms)

"""The rollout policy on figures written out by hand: when a canary step waits, advances or rolls back."""

from hetflow.serving.policy import Limits, StepFigures, VersionFigures, decide

LIMITS = Limits()  # 1% errors, p99 2x the stable's (5 ms floor), 100 requests and 5 s a step, 30 s at most
STEADY = VersionFigures(requests=900, errors=0, p99_ms=12.0)


def step(canary: VersionFigures, seconds: float = 6.0, **more) -> StepFigures:
    return StepFigures(canary=canary, stable=STEADY, seconds=seconds, **more)


def test_a_healthy_canary_advances_once_the_step_has_lasted_and_answered_enough():
    assert decide(step(VersionFigures(120, 0, 13.0)), LIMITS).action == "advance"


def test_a_step_too_short_or_too_thin_waits():
    assert decide(step(VersionFigures(120, 0, 13.0), seconds=2.0), LIMITS).action == "wait"
    assert decide(step(VersionFigures(40, 0, 13.0)), LIMITS).action == "wait"


def test_thin_traffic_advances_after_the_longest_step_saying_on_what():
    thin = decide(step(VersionFigures(7, 0, 13.0), seconds=31.0), LIMITS)
    assert (thin.action, thin.reason) == ("advance", "only 7 answers in 31 s: judged on those")
    assert decide(step(VersionFigures(0, 0, None), seconds=31.0), LIMITS).action == "advance"
    assert decide(step(VersionFigures(7, 0, 13.0), seconds=29.0), LIMITS).action == "wait"


def test_errors_on_five_percent_of_requests_roll_back_and_say_so():
    decision = decide(step(VersionFigures(200, 10, 13.0)), LIMITS)
    assert decision.action == "roll_back"
    assert decision.reason == "error rate 5.0% (10 of 200 requests), over the limit 1.0%"


def test_one_early_error_is_not_yet_a_rate_but_two_are():
    assert decide(step(VersionFigures(20, 1, 13.0), seconds=1.0), LIMITS).action == "wait"
    assert decide(step(VersionFigures(20, 2, 13.0), seconds=1.0), LIMITS).action == "roll_back"


def test_three_times_the_latency_rolls_back_on_the_third_poll_in_a_row_naming_the_limit():
    slow = VersionFigures(150, 0, 36.0)
    assert [decide(step(slow, p99_breaches=breaches), LIMITS).action for breaches in (0, 1)] == ["wait", "wait"]
    decision = decide(step(slow, p99_breaches=2), LIMITS)
    assert decision.action == "roll_back"
    assert decision.reason == (
        "p99 latency 36.0 ms over the limit 24.0 ms (2x the stable version's 12.0 ms) on 3 polls in a row"
    )


def test_a_p99_over_its_limit_never_advances_the_step():
    assert decide(step(VersionFigures(150, 0, 36.0), seconds=60.0), LIMITS).action == "wait"


def test_latency_is_judged_only_on_enough_requests():
    assert decide(step(VersionFigures(30, 0, 36.0), seconds=1.0), LIMITS).action == "wait"


def test_sub_millisecond_noise_under_the_floor_does_not_roll_back():
    fast = StepFigures(VersionFigures(150, 0, 3.9), VersionFigures(900, 0, 0.8), seconds=6.0)
    assert decide(fast, LIMITS).action == "advance"


def test_a_mirrored_disagreement_rolls_back():
    decision = decide(step(VersionFigures(150, 0, 13.0), mirrored=40, disagreed=1), LIMITS)
    assert decision.action == "roll_back"
    assert decision.reason == "1 of 40 mirrored requests answered differently from the stable version"

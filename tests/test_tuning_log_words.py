"""What the tuning DAG's logs say of a study and its trials: figures rounded, in words, never a
Python dict or a float's seventeen digits."""

from __future__ import annotations

from hetflow.tuning.space import parse_study, settings_words, study_words
from hetflow.tuning.study import outcome_words


def test_a_study_and_its_trials_read_as_words_with_rounded_figures():
    study = parse_study(
        {
            "choices": {"strategy": ["multi_worker_mirrored", "parameter_server"], "workers": [2]},
            "ranges": {"learning_rate": [0.0005, 0.01]},
            "base": {"model": "mlp", "epochs": 15},
            "target_accuracy": 0.9,
            "trials": 6,
            "parallel_trials": 2,
        }
    )
    assert study_words(study) == (
        "6 trials, 2 at a time, to validation accuracy 0.9 within 3600 s, trying strategy multi_worker_mirrored or "
        "parameter_server; workers 2; learning_rate from 0.0005 to 0.01; every trial with model=mlp, epochs=15; "
        "pruning on, seed 0"
    )
    drawn = {"strategy": "parameter_server", "workers": 2, "learning_rate": 0.0031415926535}
    assert settings_words(drawn) == "strategy=parameter_server, workers=2, learning_rate=0.00314"
    reached = {"state": "complete", "reason": None, "launch_to_target_seconds": 20.681946754455566}
    assert outcome_words(reached, 0.9) == "complete: validation accuracy 0.9 reached 20.7 s after launch"
    short = {"state": "complete", "reason": None, "launch_to_target_seconds": None, "best_accuracy": 0.87222222}
    assert outcome_words(short, 0.9) == "complete: validation accuracy 0.9 not reached (best 0.8722)"
    pruned = {"state": "pruned", "reason": "pruned at 15 s: validation accuracy 0.7833 is behind the median"}
    assert outcome_words(pruned, 0.9) == "pruned at 15 s: validation accuracy 0.7833 is behind the median"
    failed = {"state": "failed", "reason": "worker-0 exited with code 1"}
    assert outcome_words(failed, 0.9) == "failed: worker-0 exited with code 1"

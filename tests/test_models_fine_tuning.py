"""Fine-tuning stops when validation accuracy has recovered, stops improving, or reaches its maximum,
and keeps the best round's weights (hetflow/models/fine_tuning.py), on two blobs the test draws."""

from __future__ import annotations

import numpy as np
import pytest


def _blobs(seed: int, n: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """Two well-separated Gaussian blobs in 8 dimensions: class 0 around -2, class 1 around +2."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    points = rng.normal(0, 1, (n, 8)) + np.where(labels[:, None] == 1, 2.0, -2.0)
    return points.astype("float32"), labels.astype("int64")


def _trained_model(learning_rate: float):
    """A small classifier that has already learnt the blobs (validation accuracy 1.0)."""
    import tensorflow as tf

    from hetflow.models.architectures import compile_model

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, "relu"), tf.keras.layers.Dense(2)])
    compile_model(model, tf.keras.optimizers.Adam(0.01))
    model.fit(*_blobs(1), epochs=20, batch_size=32, verbose=0)
    compile_model(model, tf.keras.optimizers.SGD(learning_rate))
    return model


def _batches(points: np.ndarray, labels: np.ndarray):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((points, labels)).shuffle(400, seed=0).repeat().batch(32)


def _accuracy(model, points, labels) -> float:
    return float(np.mean(np.argmax(model.predict(points, verbose=0), axis=1) == labels))


def test_it_stops_at_the_first_check_after_the_ramp_where_validation_has_recovered():
    from hetflow.models.fine_tuning import Recovery, fine_tune

    model = _trained_model(learning_rate=0.001)
    validation = _blobs(2)
    assert _accuracy(model, *validation) == 1.0
    recovery = Recovery(target_accuracy=0.95, max_steps=200, check_every=10, first_check=25)
    record = fine_tune(model, _batches(*_blobs(3)), validation, recovery, "test")
    # Recovered all along, but not counted before the ramp's 25 steps: the check at step 30 stops it.
    assert [step for step, _ in record["validation_accuracy"]] == [10, 20, 30]
    assert (record["steps"], record["stopped"], record["max_steps"]) == (30, "recovered", 200)


def test_a_fine_tuning_that_only_makes_it_worse_stops_improving_and_keeps_the_best_weights():
    from hetflow.models.fine_tuning import Recovery, fine_tune

    # Labels shuffled at a large rate: every round unlearns the blobs a little more.
    model = _trained_model(learning_rate=0.5)
    validation = _blobs(2)
    points, labels = _blobs(3)
    wrong = np.random.default_rng(4).permutation(labels)
    recovery = Recovery(target_accuracy=1.01, max_steps=400, check_every=10, patience=3)
    record = fine_tune(model, _batches(points, wrong), validation, recovery, "test")
    scores = [accuracy for _, accuracy in record["validation_accuracy"]]
    assert record["stopped"] == "stopped_improving" and record["steps"] < 400, record
    best = int(np.argmax(scores))
    assert len(scores) == best + 1 + recovery.patience  # patience rounds without beating the best
    assert scores[-1] < scores[best]
    # The weights put back are the best round's, not the last one's.
    assert _accuracy(model, *validation) == pytest.approx(scores[best], abs=1e-6)


def test_a_fine_tuning_that_neither_recovers_nor_stalls_runs_to_its_maximum_in_whole_checks():
    from hetflow.models.fine_tuning import Recovery, fine_tune

    model = _trained_model(learning_rate=0.001)
    recovery = Recovery(target_accuracy=1.01, max_steps=75, check_every=20, patience=100)
    record = fine_tune(model, _batches(*_blobs(3)), _blobs(2), recovery, "test")
    assert [step for step, _ in record["validation_accuracy"]] == [20, 40, 60]
    assert (record["steps"], record["stopped"], record["max_steps"]) == (60, "max_steps", 60)

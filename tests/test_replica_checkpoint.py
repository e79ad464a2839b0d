"""The custom loops' checkpoint (EpochCheckpoint): one run's state, whichever replica reads it."""

from __future__ import annotations

import numpy as np

from hetflow.models.architectures import build_model
from hetflow.paths import RunPaths
from hetflow.spec import parse_spec


def _checkpoint(paths: RunPaths, chief: bool, seed: int):
    import tensorflow as tf

    from hetflow.replica.checkpoint import EpochCheckpoint

    model = build_model("mlp", [8, 8, 1], 10, seed)
    return model, EpochCheckpoint(parse_spec({}), paths, chief, model, tf.keras.optimizers.SGD(0.1))


def test_every_replica_resumes_from_the_chiefs_checkpoint_and_only_the_chiefs_is_the_runs(tmp_path):
    paths = RunPaths(tmp_path)
    chief_model, chief = _checkpoint(paths, chief=True, seed=1)
    assert chief.restore() == 0
    chief.epoch_done(3)

    worker_model, worker = _checkpoint(paths, chief=False, seed=2)  # other initial weights
    assert worker.restore() == 3
    for trained, resumed in zip(chief_model.get_weights(), worker_model.get_weights()):
        np.testing.assert_array_equal(trained, resumed)

    worker.epoch_done(4)  # a non-chief's save goes to its scratch dir, not to the run's checkpoint
    _, late = _checkpoint(paths, chief=False, seed=3)
    assert late.restore() == 3

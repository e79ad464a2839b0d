"""Distributed training on real replica processes talking gRPC on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import hetflow

pytestmark = pytest.mark.slow


def train(env, *sets: str) -> tuple[dict, Path]:
    """``hetflow train`` with these keys; returns training.json and the run directory."""
    args = ["train"]
    for assignment in sets:
        args += ["--set", assignment]
    done = hetflow(env, *args)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record_path = Path(done.stdout.strip().splitlines()[-1])
    return json.loads(record_path.read_text()), record_path.parent


def model_weights(run_dir: Path) -> list[np.ndarray]:
    import tensorflow as tf

    return tf.keras.models.load_model(run_dir / "model.keras", compile=False).get_weights()


def test_two_workers_with_half_batches_match_one_worker_with_the_whole_batch(hetflow_env):
    """Sync all-reduce is exact: 2 MWMS workers x batch B/2 == 1 worker x batch B after K steps."""
    same = ["optimizer=sgd", "learning_rate=0.1", "shuffle=false", "epochs=1", "steps_per_epoch=8", "batch_size=32"]
    _, single = train(hetflow_env, "strategy=one_device", *same)
    record, pair = train(hetflow_env, "strategy=multi_worker_mirrored", "workers=2", *same)
    assert record["replicas_in_sync"] == 2 and record["per_replica_batch"] == 16
    assert sorted(record["per_worker"]) == ["worker-0", "worker-1"]
    single_weights, pair_weights = model_weights(single), model_weights(pair)
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(single_weights, pair_weights))
    assert difference <= 1e-5
    from tasks.models import build_model

    initial = build_model("mlp", [8, 8, 1], 10, seed=42).get_weights()
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(single_weights, initial))
    assert moved > 100 * difference and moved > 1e-3  # training changed the weights; both runs alike

"""A synchronous run's all-reduce, recorded apart from its computation (hetflow/replica/collectives.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import hetflow

pytestmark = pytest.mark.slow


def test_two_sync_workers_record_one_all_reduce_per_step_of_every_parameter_in_float32(hetflow_env):
    sets = ["strategy=multi_worker_mirrored", "workers=2", "batch_size=32", "epochs=1", "steps_per_epoch=5"]
    done = hetflow(hetflow_env, "train", *[token for key in sets for token in ("--set", key)])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record = json.loads(Path(done.stdout.strip().splitlines()[-1]).read_text())
    from hetflow.models.architectures import build_model

    # The digits MLP the run trained (the default model on the default dataset's 8x8 images).
    parameters = build_model("mlp", [8, 8, 1], 10, seed=42).count_params()
    collectives = record["collectives"]
    # Read from the traced step: what its all-reduce ops carry, all of it in one collective.
    assert collectives["bytes_per_step"] == 4 * parameters
    assert collectives["dtypes"] == ["float32"]
    assert collectives["collectives_per_step"] == 1
    assert collectives["seconds_per_step"] > 0

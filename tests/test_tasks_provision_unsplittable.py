"""A model_parallel run whose model no cut fits into its replicas' memory is refused before any
replica starts, in one line (``hetflow.replica.stage_profile.refuse_unsplittable``)."""

from __future__ import annotations

import pytest
from conftest import hetflow

pytestmark = pytest.mark.slow


def test_a_model_no_cut_fits_is_refused_in_one_line_before_any_replica_starts(hetflow_env, tmp_path):
    # A home of its own: the session's holds other tests' wide_mlp runs.
    env = {**hetflow_env, "HETFLOW_HOME": str(tmp_path / "home")}
    sets = ["strategy=model_parallel", "workers=2", "model=wide_mlp", "replica_memory_mb=1000"]
    sets += ["epochs=1", "steps_per_epoch=2", "train_timeout_seconds=60"]  # short, were it not refused
    done = hetflow(env, "train", *[arg for assignment in sets for arg in ("--set", assignment)])
    assert done.returncode != 0
    [reason] = [line for line in done.stderr.splitlines() if line.startswith("hetflow: ")]
    assert "model_parallel cannot split model=wide_mlp over workers=2: replica_memory_mb=1000 is too small" in reason
    assert reason.endswith("expected at least 1029")
    assert "Traceback" not in done.stderr
    # provision_cluster refused before it started anything: no replica wrote a log.
    [run_dir] = [spec.parent for spec in (tmp_path / "home" / "runs").glob("*/spec.json")]
    assert (run_dir / "dataset.json").exists() and not (run_dir / "cluster.json").exists()
    assert not list(run_dir.glob("logs/*.log"))

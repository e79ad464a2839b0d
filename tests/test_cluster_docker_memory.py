"""Model parallelism's reason to exist, on docker: a model one container cannot hold fails there in
one line, and trains with its layer groups split over two containers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import hetflow

pytestmark = pytest.mark.usefixtures("docker_client")


# wide_mlp's training state (67 M parameters: weights, gradients and Adam's two slots, about 1.1 GB)
# with TensorFlow's own ~0.4 GB does not fit one container at this limit; half of it on each of two
# stages does. The containers' largest resident memory, polled from their cgroups on this job: one
# device 1673 MiB; split, each stage 1074 to 1141 MiB (and the chief up to 1090). At 1200 MB a CI
# run's worker-0 was once killed: the limit sits between the two.
TOO_BIG = ("model=wide_mlp", "replica_memory_mb=1400", "epochs=1", "steps_per_epoch=3", "backend=docker")


@pytest.mark.heavy  # make test splits a model over two replicas (test_e2e_run); this is its memory-limit variant
@pytest.mark.slow
def test_a_model_one_container_cannot_hold_fails_in_one_line_there_and_trains_split_over_two(
    hetflow_env,
):
    args = [arg for assignment in (*TOO_BIG, "strategy=one_device") for arg in ("--set", assignment)]
    alone = hetflow(hetflow_env, "train", *args)
    assert alone.returncode != 0
    [reason] = [line for line in alone.stderr.splitlines() if line.startswith("hetflow: ")]
    assert (
        "replica worker-0 killed by SIGKILL (ran out of memory: the kernel ended it at its replica_memory_mb" in reason
    )
    # Split by parameters, so by memory: the measured split balances each stage's time, and on a busy
    # machine it once gave worker-0 more state than its limit holds (a CI run beside other tests).
    split_by_memory = ("strategy=model_parallel", "workers=2", "stage_split=parameters")
    args = [arg for assignment in (*TOO_BIG, *split_by_memory) for arg in ("--set", assignment)]
    split = hetflow(hetflow_env, "train", *args)
    assert split.returncode == 0, split.stdout[-3000:] + split.stderr[-3000:]
    record = json.loads(Path(split.stdout.strip().splitlines()[-1]).read_text())
    assert record["epochs_done"] == 1 and all(worker["layers"] for worker in record["per_worker"].values())
    held = [worker["variable_bytes"] + worker["slot_bytes"] for worker in record["per_worker"].values()]
    assert max(held) < 0.7 * sum(held)  # neither container holds most of the model's state

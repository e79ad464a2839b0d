"""The cases of ``make bench`` (bench/run.py): the job every case trains, what each case is, and the
command that runs it."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the virtualenv's bin, where `hetflow` is installed

# What every case shares, passed explicitly to hetflow and to the baseline alike.
COMMON = {"dataset": "synthetic_cifar", "model": "convnet", "optimizer": "adam", "learning_rate": 0.001, "seed": 42}
PER_WORKER_BATCH = 64
# The peer's packages, pinned, installed on first use beside .venv rather than into it (TensorFlow
# and the rest stay .venv's), and put on PYTHONPATH for the peer's case alone.
PEER_LOCK = REPO_ROOT / "bench" / "ray-requirements.lock"
PEER_PACKAGES = REPO_ROOT / ".bench-ray"


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    # hetflow spec keys on top of COMMON and the step counts; None for the cases that are no
    # hetflow run. batch_size is global: PER_WORKER_BATCH times the workers that share one step.
    settings: dict[str, Any] | None
    # For the cases that are no hetflow run: their script under bench/ and its extra arguments.
    script: str | None = None
    script_args: tuple[str, ...] = ()
    # Needs the peer's packages (PEER_LOCK): not run unless asked for, as it may have to download them.
    peer: bool = False
    # Copies of the job run at once, copy i pinned to core i; their examples/s are summed.
    side_by_side: int = 1


CASES = (
    Case("baseline", "plain single-process model.fit, TensorFlow's default threads", None, script="baseline.py"),
    Case(
        "one_worker",
        "hetflow, 1 replica, one_device, 1 thread",
        {"strategy": "one_device", "batch_size": PER_WORKER_BATCH, "replica_threads": 1},
    ),
    Case(
        "mwms_2",
        "hetflow, 2 workers, multi_worker_mirrored, 1 thread each, pinned",
        {
            "strategy": "multi_worker_mirrored",
            "workers": 2,
            "batch_size": 2 * PER_WORKER_BATCH,
            "replica_threads": 1,
            "pin_cores": True,
        },
    ),
    Case(
        "ps_2w_1ps",
        "hetflow, chief + 2 workers + 1 ps, parameter_server (async), 1 thread each, pinned "
        "(the ps on worker-0's core, the chief on worker-1's)",
        # Under parameter_server each step runs on one worker, so its batch is one worker's.
        {
            "strategy": "parameter_server",
            "workers": 2,
            "ps": 1,
            "batch_size": PER_WORKER_BATCH,
            "replica_threads": 1,
            "pin_cores": True,
        },
    ),
    Case(
        "two_apart",
        "two one_worker jobs at once, each pinned to a core of its own, no communication (summed)",
        {"strategy": "one_device", "batch_size": PER_WORKER_BATCH, "replica_threads": 1},
        side_by_side=2,
    ),
    Case(
        "ray_2w",
        "Ray Train TensorflowTrainer, 2 workers, multi_worker_mirrored, 1 thread each, not pinned",
        None,
        script="ray_peer.py",
        script_args=("--workers=2",),
        peer=True,
    ),
)
CASE_NAMES = tuple(case.name for case in CASES)
DEFAULT_CASES = tuple(case.name for case in CASES if not case.peer)


class RunFailed(RuntimeError):
    pass


def _spec_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def case_command(case: Case, epochs: int, steps_per_epoch: int) -> list[str]:
    if case.settings is None:
        return [
            str(BIN / "python"),
            f"bench/{case.script}",
            f"--dataset={COMMON['dataset']}",
            f"--model={COMMON['model']}",
            f"--epochs={epochs}",
            f"--steps-per-epoch={steps_per_epoch}",
            f"--batch-size={PER_WORKER_BATCH}",
            f"--optimizer={COMMON['optimizer']}",
            f"--learning-rate={COMMON['learning_rate']}",
            f"--seed={COMMON['seed']}",
            *case.script_args,
        ]
    settings = {**COMMON, "epochs": epochs, "steps_per_epoch": steps_per_epoch, **case.settings}
    command = [str(BIN / "hetflow"), "train"]
    for key, value in settings.items():
        command += ["--set", f"{key}={_spec_value(value)}"]
    return command

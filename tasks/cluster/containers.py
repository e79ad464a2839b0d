"""What the docker and kubernetes backends share: each replica's environment and GPU count, the
supervision policy, and log streaming.

The policy is a pure function of the replicas' states (``verdict``), the way the Kubeflow training
operator keeps restart and clean-up policies as data: the backends only translate their engine's
view of a container or pod into a ``ReplicaState`` and carry out what the verdict says.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Literal

from tasks.cluster.layout import ClusterLayout, Replica
from tasks.cluster.local import RUN_ID_ENV, ReplicaFailed
from tasks.spec import RunSpec

log = logging.getLogger("hetflow.cluster")

# Grace between SIGTERM and SIGKILL when stopping a replica: a TF worker waiting for a peer
# ignores SIGTERM (see the local backend), so the engine's escalation is what ends it.
STOP_GRACE_SECONDS = 10


def replica_environment(layout: ClusterLayout, replica: Replica, home: Path, launched_at: float) -> dict[str, str]:
    """The replica's environment: the same TF_CONFIG and run id as a local replica, and the
    HETFLOW_HOME that the run directory is mounted under (the same path as on the supervisor, so
    the paths that earlier stages recorded resolve inside the container too)."""
    return {
        "TF_CONFIG": layout.tf_config(replica),
        RUN_ID_ENV: layout.run_id,
        "HETFLOW_HOME": str(home),
        "HETFLOW_LAUNCH_TIME": repr(launched_at),
        "PYTHONUNBUFFERED": "1",
    }


def replica_gpus(spec: RunSpec, replica: Replica) -> int:
    """GPUs to request for the replica: ``devices_per_worker`` for the replicas that compute, none
    for a ps or for the chief of parameter_server (it only schedules steps)."""
    if not spec.request_gpus or replica.role == "ps":
        return 0
    if spec.strategy == "parameter_server" and replica.role == "chief":
        return 0
    return spec.devices_per_worker


@dataclass(frozen=True)
class ReplicaState:
    exit_code: int | None = None  # None while it runs (or waits to be restarted)
    restarts: int = 0
    # Why it cannot start at all (an image that cannot be pulled): waiting would only time out.
    stuck: str | None = None


@dataclass(frozen=True)
class Verdict:
    outcome: Literal["running", "succeeded", "failed"]
    stop: tuple[str, ...] = ()  # replicas to stop now
    failed: str | None = None  # the replica that failed the run


def verdict(layout: ClusterLayout, states: dict[str, ReplicaState], restart_policy: str, backoff_limit: int) -> Verdict:
    """What to do, given every replica's state.

    - A replica that exited non-zero fails the run, unless ``on_failure`` leaves it restarts
      (the engine restarts it, and the run goes on).
    - A server replica (ps; a worker under parameter_server) that exits at all fails the run:
      it serves until stopped.
    - When every training replica has exited 0, the run succeeded and the server replicas still
      running are stopped: without that, ps pods outlive the job (the classic TFJob complaint).
    """
    everyone = tuple(r.name for r in layout.replicas)
    for replica in layout.replicas:
        state = states[replica.name]
        if state.stuck:
            return Verdict("failed", everyone, replica.name)
        if state.exit_code is None:
            continue
        restarted = restart_policy == "on_failure" and state.exit_code != 0 and state.restarts < backoff_limit
        if not restarted and (state.exit_code != 0 or replica.serves_until_stopped):
            return Verdict("failed", everyone, replica.name)
    training = [r.name for r in layout.replicas if not r.serves_until_stopped]
    if all(states[name].exit_code == 0 for name in training):
        return Verdict("succeeded", tuple(r.name for r in layout.replicas if r.serves_until_stopped))
    return Verdict("running")


def supervise(
    layout: ClusterLayout,
    spec: RunSpec,
    poll: Callable[[], dict[str, ReplicaState]],
    stop: Callable[[tuple[str, ...]], None],
    tails: dict[str, deque[str]],
    timeout: float,
    interval: float = 1.0,
) -> dict[str, int]:
    """Poll the replicas and act on the verdict until the run succeeds (returns the exit codes of
    the training replicas), fails or times out (raise ReplicaFailed, as the local backend does)."""
    deadline = time.monotonic() + timeout
    while True:
        states = poll()
        decision = verdict(layout, states, spec.restart_policy, spec.backoff_limit)
        if decision.outcome == "succeeded":
            stop(decision.stop)
            return {name: state.exit_code for name, state in states.items() if state.exit_code is not None}
        if decision.outcome == "failed":
            stop(decision.stop)
            name, state = decision.failed, states[decision.failed]
            if state.stuck:
                raise ReplicaFailed(f"replica {name} could not start: {state.stuck}")
            tail = " | ".join(tails[name]) or "(no output)"
            raise ReplicaFailed(f"replica {name} exited with code {state.exit_code}; last output: {tail}")
        if time.monotonic() > deadline:
            running = tuple(r.name for r in layout.replicas if states[r.name].exit_code is None)
            stop(tuple(r.name for r in layout.replicas))
            raise ReplicaFailed(
                f"training timed out after {timeout:.0f} s (train_timeout_seconds); stopped {', '.join(running)}"
            )
        time.sleep(interval)


def pump_lines(name: str, chunks: Iterable[bytes], log_path: Path, tail: deque[str]) -> None:
    """Write a replica's output, as the engine streams it in arbitrary chunks, line by line to its
    log file and to the supervisor's log prefixed with its name (as the local backend does)."""
    pending = b""
    with open(log_path, "a", encoding="utf-8") as log_file:

        def emit(raw: bytes) -> None:
            line = raw.decode("utf-8", "replace").rstrip()
            log_file.write(line + "\n")
            log_file.flush()
            tail.append(line)
            log.info("[%s] %s", name, line)

        for chunk in chunks:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                emit(raw)
        if pending:
            emit(pending)

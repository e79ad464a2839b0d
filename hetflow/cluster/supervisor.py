"""One supervision for every backend: watch the replicas, decide success, failure or restart, and
stream their output.

A backend (local processes, Docker containers, Kubernetes pods) only starts, inspects and stops
its replicas (``Replicas``). The policy is a pure function of the replicas' states (``decide``),
the way the Kubeflow training operator keeps restart and clean-up policies as data; ``Supervisor``
carries out what it decides, records every restart in the run directory (``restarts.json``) and
streams each replica's output into this process's log, prefixed with its name.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from hetflow.cluster.backends.base import Replicas, ReplicaState, backend_for
from hetflow.cluster.layout import ClusterLayout
from hetflow.paths import NotRegularFile, RunPaths, read_replica_record, write_record
from hetflow.pipeline.progress import StoppedEarly
from hetflow.spec import RunSpec

log = logging.getLogger("hetflow.cluster")


class ReplicaFailed(RuntimeError):
    pass


_RESTART_TEXT = ("replica", "cause", "action")  # what readers put in tags and summaries


def read_restarts(paths: RunPaths) -> list[dict]:
    """The restarts the supervisor recorded (``[]`` before the first). They lie in a folder replicas
    see read-only; read bounded and typed all the same, as anything in a run directory they write into."""
    if not paths.restarts.exists():
        return []
    restarts = read_replica_record(paths.restarts, list)
    for restart in restarts:
        if not (
            isinstance(restart, dict)
            and all(isinstance(restart.get(key), str) for key in _RESTART_TEXT)
            and isinstance(restart.get("exit_code"), (int, type(None)))
        ):
            raise NotRegularFile(f"{paths.restarts} holds a restart the supervisor did not write: refused")
    return restarts


def _killed(exit_code: int) -> bool:
    """Ended by a signal: negative here, 128+N from a shell or a container engine."""
    return exit_code < 0 or exit_code > 128


def restartable(policy: str, exit_code: int) -> bool:
    """Whether restart_policy restarts a replica that exited with ``exit_code`` (TFJob's policies):
    ``exit_code`` restarts only what was killed by a signal (negative here, or 128+N from a shell
    or a container engine), taking codes 1-127 for errors a restart would repeat."""
    if policy == "on_failure":
        return True
    return policy == "exit_code" and _killed(exit_code)


@dataclass(frozen=True)
class Decision:
    outcome: Literal["running", "succeeded", "failed", "restart"]
    replicas: tuple[str, ...] = ()  # to stop (succeeded, failed) or to restart
    cause: str | None = None  # the replica that failed the run or is restarted


def decide(
    layout: ClusterLayout,
    states: dict[str, ReplicaState],
    restart_policy: str,
    backoff_limit: int,
    restarts_done: int,
    restarts_in_place: bool = False,
) -> Decision:
    """What to do, given every replica's state.

    - A training replica that exited non-zero, or a server replica (ps; a worker under
      parameter_server, a stage under model_parallel across workers) that exited at all, is
      restarted while the policy allows it and fewer than ``backoff_limit`` restarts were made;
      otherwise it fails the run. An async worker is restarted alone (the coordinator goes on with
      the others and it rejoins on its address); anything else restarts the whole group (sync
      workers cannot go on without a peer; without its ps, or a stage and the variables it held,
      the chief fails), which resumes from the last checkpoint.
    - Where the engine restarts in place, a replica it is restarting counts as running.
    - When every training replica has exited 0, the run succeeded and the server replicas still
      running are stopped: without that, ps outlive the job (the classic TFJob complaint).
    """
    everyone = tuple(r.name for r in layout.replicas)
    ended = []  # replicas that exited when they should not have
    for replica in layout.replicas:
        state = states[replica.name]
        if state.stuck:
            return Decision("failed", everyone, replica.name)
        if state.exit_code is None or (state.exit_code == 0 and not replica.serves_until_stopped):
            continue
        if restarts_in_place and restart_policy == "on_failure" and state.exit_code != 0:
            if state.restarts < backoff_limit:
                continue  # the engine is restarting it
        ended.append(replica)
    if ended:
        # A replica killed by a signal takes its peers down with errors: it is the cause.
        replica = next((r for r in ended if _killed(states[r.name].exit_code)), ended[0])
        exit_code = states[replica.name].exit_code
        if not restarts_in_place and restartable(restart_policy, exit_code) and restarts_done < backoff_limit:
            # Only an async worker holds nothing: a model_parallel stage held its layers' variables.
            asynchronous = any(r.role == "ps" for r in layout.replicas)
            alone = asynchronous and replica.serves_until_stopped and replica.role == "worker"
            return Decision("restart", (replica.name,) if alone else everyone, replica.name)
        return Decision("failed", everyone, replica.name)
    training = [r.name for r in layout.replicas if not r.serves_until_stopped]
    if all(states[name].exit_code == 0 for name in training):
        return Decision("succeeded", tuple(r.name for r in layout.replicas if r.serves_until_stopped))
    return Decision("running")


def exit_description(exit_code: int) -> str:
    """``killed by SIGKILL`` for a signal (negative, or 128+N from a container), else the code."""
    number = -exit_code if exit_code < 0 else exit_code - 128 if exit_code > 128 else 0
    if number:
        try:
            return f"killed by {signal.Signals(number).name}"
        except ValueError:
            pass
    return f"exited with code {exit_code}"


# The last line of a Python traceback: ``tensorflow...errors_impl.UnavailableError: ...``.
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b(:|$)")
# A replica's progress line (hetflow.replica.loop), and TensorFlow's complaint where no GPU is.
_EPOCH_LINE = re.compile(r"^Epoch \d+/\d+ ")
_NO_GPU_LINE = re.compile(r"\] failed call to cuInit: ")
# TensorFlow's own log lines (``E0000 00:00:17.. cuda_platform.cc:52] failed call to cuInit``):
# start-up noise, not what ended the replica.
_ABSL_LINE = re.compile(r"^[IWEF]\d{4} ")


def last_error_line(tail: Iterable[str]) -> str:
    """What most likely ended the replica: its last exception line, else its last line that is
    not one of TensorFlow's log lines."""
    lines = [line.strip() for line in tail if line.strip()]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return line
    plain = [line for line in lines if not _ABSL_LINE.match(line)]
    return plain[-1] if plain else "(no output)"


class Supervisor:
    """Watches one run's replicas until training succeeds, fails or times out."""

    def __init__(
        self,
        layout: ClusterLayout,
        restart_policy: str,
        backoff_limit: int,
        replicas: Replicas,
        run_dir: Path,
        loss_report_seconds: float = 0.0,
        log_label: str = "",
    ):
        """:param loss_report_seconds: how long the engine may take to report a replica lost with its
        machine (Swarm: until the node misses its heartbeats), while its peers already exited with
        errors: a failure whose cause is not a signal waits this long for the real cause.
        :param log_label: what names the run before each replica's name in this process's log
        (``[trial-1 worker-0]``: a study's trials share the task's log)."""
        self.layout = layout
        self.log_label = log_label
        self.loss_report_seconds = loss_report_seconds
        self.restart_policy = restart_policy
        self.backoff_limit = backoff_limit
        self.replicas = replicas
        self.restarts_path = RunPaths(run_dir).restarts
        self.restarts = read_restarts(RunPaths(run_dir))
        self.tails: dict[str, deque[str]] = {r.name: deque(maxlen=20) for r in layout.replicas}
        self._followers: dict[str, list[threading.Thread]] = {r.name: [] for r in layout.replicas}
        self._started_at = time.monotonic()
        self._ended: set[str] = set()

    def follow(self, names: Iterable[str], since: float = 0.0) -> None:
        """Stream these replicas' output into this process's log from ``since`` (epoch seconds)."""
        for name in names:
            follower = threading.Thread(target=self._follow, args=(name, since), daemon=True)
            follower.start()
            self._followers[name].append(follower)

    def _follow(self, name: str, since: float) -> None:
        chief = self._chief()
        for line in self.replicas.lines(name, since):
            self.tails[name].append(line)
            # One line per epoch in the task log, the chief's (it names every worker's rate); the
            # others' stay in their own logs and failure messages. TensorFlow's cuInit complaint on
            # a machine without a GPU is start-up noise, not news.
            quiet = (name != chief and _EPOCH_LINE.match(line)) or _NO_GPU_LINE.search(line)
            log.log(logging.DEBUG if quiet else logging.INFO, "[%s] %s", f"{self.log_label} {name}".lstrip(), line)

    def _chief(self) -> str:
        names = [replica.name for replica in self.layout.replicas]
        return "chief-0" if "chief-0" in names else "worker-0"

    def wait(self, timeout: float, interval: float = 0.2, should_stop=None) -> dict[str, int]:
        """Act on ``decide`` every ``interval`` seconds until the run succeeds (returns the training
        replicas' exit codes), fails or passes ``timeout`` seconds (ReplicaFailed, after stopping
        every replica), or ``should_stop()`` gives a reason (StoppedEarly, after stopping every
        replica). The interval is part of the wait between the final weights and the command's exit."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                states, decision = self._decide()
                if decision.outcome in ("failed", "restart") and self.loss_report_seconds:
                    settle = time.monotonic() + self.loss_report_seconds
                    while self._blames_an_error(states, decision) and time.monotonic() < settle:
                        time.sleep(interval)
                        states, decision = self._decide()
                if decision.outcome == "succeeded":
                    if decision.replicas:
                        log.info("stopping %s: training is done", ", ".join(decision.replicas))
                    self.replicas.stop(decision.replicas)
                    return {name: s.exit_code for name, s in states.items() if s.exit_code is not None}
                if decision.outcome == "failed":
                    self.replicas.stop(decision.replicas)
                    self._drain()  # the replica's last lines, for the message
                    raise ReplicaFailed(self._failure(decision.cause, states[decision.cause]))
                if decision.outcome == "restart":
                    self._restart(decision, states[decision.cause])
                    continue
                if should_stop is not None and (reason := should_stop()):
                    self.replicas.stop(tuple(r.name for r in self.layout.replicas))
                    raise StoppedEarly(f"training stopped early: {reason}")
                if time.monotonic() > deadline:
                    running = [r.name for r in self.layout.replicas if states[r.name].exit_code is None]
                    self.replicas.stop(tuple(r.name for r in self.layout.replicas))
                    raise ReplicaFailed(
                        f"training timed out after {timeout:.0f} s (train_timeout_seconds); "
                        f"stopped {', '.join(running)}"
                    )
                time.sleep(interval)
        finally:
            self._drain()

    @staticmethod
    def _blames_an_error(states: dict[str, ReplicaState], decision: Decision) -> bool:
        """Whether the decision's cause merely exited with an error (what a peer of a lost replica does)."""
        cause = states[decision.cause]
        return cause.stuck is None and cause.exit_code is not None and not _killed(cause.exit_code)

    def _decide(self) -> tuple[dict[str, ReplicaState], Decision]:
        states = self.replicas.poll()
        self._report_ended(states)
        decision = decide(
            self.layout,
            states,
            self.restart_policy,
            self.backoff_limit,
            len(self.restarts),
            self.replicas.restarts_in_place,
        )
        return states, decision

    def _report_ended(self, states: dict[str, ReplicaState]) -> None:
        for name, state in states.items():
            if state.exit_code is not None and name not in self._ended:
                log.info("%s %s", name, "finished" if state.exit_code == 0 else exit_description(state.exit_code))
            if state.exit_code is None:
                self._ended.discard(name)  # restarted
            else:
                self._ended.add(name)

    def _failure(self, name: str, state: ReplicaState) -> str:
        if state.stuck:
            return f"replica {name} could not start: {state.stuck}"
        tail = " | ".join(self.tails[name]) or "(no output)"
        note = f" ({state.note})" if state.note else ""
        return f"replica {name} {exit_description(state.exit_code)}{note}; last output: {tail}"

    def _restart(self, decision: Decision, state: ReplicaState) -> None:
        name = decision.cause
        self.replicas.stop(decision.replicas)
        self._drain(decision.replicas)  # the cause is read from the replica's last lines
        action = f"restarted {name}" if decision.replicas == (name,) else "restarted every replica"
        record = {
            "replica": name,
            "exit_code": state.exit_code,
            "cause": f"{exit_description(state.exit_code)}{f' ({state.note})' if state.note else ''}; "
            f"last error: {last_error_line(self.tails[name])}",
            "action": action,
            "after_seconds": round(time.monotonic() - self._started_at, 1),
        }
        self.restarts.append(record)
        log.warning(
            "%s %s: %s (%d of backoff_limit %d)", name, record["cause"], action, len(self.restarts), self.backoff_limit
        )
        write_record(self.restarts_path, self.restarts)
        restarted_at = time.time()
        self.replicas.start([r for r in self.layout.replicas if r.name in decision.replicas])
        self.follow(decision.replicas, since=restarted_at)

    def _drain(self, names: Iterable[str] | None = None) -> None:
        """Let the followers (of ``names``, default all) print what the replicas wrote last."""
        for name in self._followers if names is None else names:
            for follower in self._followers[name]:
                follower.join(timeout=5)


def start(spec: RunSpec, run_id: str, paths: RunPaths) -> Replicas:
    """Lay out the run's cluster on its backend, record the layout (cluster.json) and start every
    replica."""
    paths.restarts.unlink(missing_ok=True)  # a re-provisioned run starts its restart count anew
    backend = backend_for(spec)
    layout = backend.plan(spec, run_id)
    write_record(paths.cluster, layout.to_dict())
    cluster = backend.replicas(spec, layout, paths.root)
    cluster.provision()
    return cluster


def supervise(
    spec: RunSpec, cluster: Replicas, run_dir: Path, timeout: float, should_stop=None, log_label: str = ""
) -> dict[str, int]:
    """Watch ``cluster`` (provisioned replicas) until training ends: the training replicas' exit
    codes, or ReplicaFailed (StoppedEarly once ``should_stop()`` gives a reason). Local replicas live
    only while a supervisor holds their lease. ``log_label`` names the run in the replicas' log lines."""
    supervisor = Supervisor(
        cluster.layout,
        spec.cluster.run_policy.restart_policy,
        spec.cluster.run_policy.backoff_limit,
        cluster,
        run_dir,
        backend_for(spec).loss_report_seconds,
        log_label,
    )
    cluster.attach()
    try:
        supervisor.follow(r.name for r in cluster.layout.replicas)
        return supervisor.wait(timeout, should_stop=should_stop)
    finally:
        cluster.detach()

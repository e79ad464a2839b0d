"""Keeper of one local replica: ``python -m hetflow.cluster.backends.local.keeper --run-dir DIR --name worker-0``.

Provisioning starts one keeper per replica, each in a session of its own, so that the replicas
outlive the process that provisioned them (an Airflow task) and are supervised by the next one
(``train``). What a container engine does for a container, the keeper does for a process:

- runs the replica (``python -m hetflow.replica``) in a process group of its own, sandboxed
  (``hetflow.sandbox``: bubblewrap, joined to the run's network namespace, which the run's network
  holder keeps, see ``hetflow.cluster.backends.local.netns``) and tied to the keeper (``--die-with-parent``), with an
  allow-listed environment, its output appended to ``logs/<name>.log``;
- pins it to a core and throttles it (a simulated slower machine) as told, and bounds its tasks and
  memory (its own cgroups; where none can be made, its tasks by an rlimit: ``hetflow.cluster.backends.local.limits``);
- records how it ended in ``replicas/<name>.exit`` (the exit code; negative: killed by that
  signal), which is how the supervisor, not being its parent, learns it;
- ends it on SIGTERM (SIGTERM, then SIGKILL after the grace period: a TF worker waiting on a peer
  ignores SIGTERM) and at the deadline;
- ends it at once when the run's supervisor is gone: a supervisor holds the run's lease (an
  exclusive lock on ``replicas/supervisor.lock``, which the kernel drops when its holder dies,
  however it dies); a replica whose supervisor held the lease and no longer does, or that no
  supervisor took within ``ATTACH_TIMEOUT_SECONDS`` of its start, is killed
  (``hetflow.cluster.lease.Supervision``, the rule container replicas apply to themselves). So
  killing the ``train`` task leaves no replica behind, as when replicas were its children.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hetflow import sandbox, seccomp
from hetflow.cluster.backends.local import limits, netns
from hetflow.cluster.backends.local.throttle import Throttle
from hetflow.cluster.lease import Supervision, supervisor_holds_lease
from hetflow.cluster.processes import TERM_GRACE_SECONDS, signal_group
from hetflow.paths import REPO_ROOT, RunPaths

_PR_SET_PDEATHSIG = 1
_KEYCTL_JOIN_SESSION_KEYRING = 1


def exit_path(run_dir: Path, name: str) -> Path:
    return RunPaths(run_dir).replicas / f"{name}.exit"


def _replica_preexec(core: int | None, bounds: limits.ReplicaLimits | None = None):
    """Runs in the replica before exec: die with the keeper; a session keyring of its own, empty,
    not the keeper's (the task's, whatever it holds); inside its cgroups (or under its rlimits); optionally
    on one core."""
    keyctl = seccomp.syscall_number("keyctl")

    def preexec() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if libc.syscall(keyctl, _KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
            raise OSError(ctypes.get_errno(), "no session keyring of its own")
        if bounds is not None:
            bounds.enter()
        if core is not None:
            os.sched_setaffinity(0, {core})

    return preexec


# What a replica's environment may hold: the keeper's own (the task's: under `make up` Airflow's
# secrets) stays outside the sandbox.
REPLICA_ENVIRONMENT = (
    "PATH",
    "LANG",
    "LC_ALL",
    "TZ",
    "TF_CONFIG",
    "TF_CPP_MIN_LOG_LEVEL",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONUNBUFFERED",
    "HETFLOW_HOME",
    "HETFLOW_RUN_ID",
    "HETFLOW_LAUNCH_TIME",
)


def replica_environment() -> dict[str, str]:
    env = {key: os.environ[key] for key in REPLICA_ENVIRONMENT if key in os.environ}
    return {**env, "HOME": "/tmp"}  # the real one is not there


@dataclass(frozen=True)
class View:
    """What the replica sees (``hetflow.sandbox.Sandbox``); None: it runs unisolated."""

    read_write: list[str]
    read_only: list[str]
    hidden: list[str]


def replica_sandbox(view: View, run_dir: Path) -> sandbox.Sandbox:
    """The sandbox every replica of the run gets: ``view``'s files, the run's network namespace, the
    run's own uid."""
    network = netns.join(run_dir)
    return sandbox.Sandbox(
        view.read_write,
        view.read_only,
        view.hidden,
        network,
        working_directory=str(REPO_ROOT),
        owner=sandbox.run_owner(run_dir),
    )


def _launch(command: list[str], view: View | None, run_dir: Path, log_file, core: int | None, bounds=None):
    """Start ``command`` in a process group of its own, sandboxed in the run's network namespace
    where ``view`` says so."""
    box = None
    if view is not None:
        box = replica_sandbox(view, run_dir)
        command = box.command(command)
    try:
        return subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=replica_environment(),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_replica_preexec(core, bounds),
            pass_fds=box.fds if box else (),
        )
    finally:
        if box is not None:
            box.close()


def keep(
    run_dir: Path,
    name: str,
    core: int | None,
    slowdown: float,
    deadline: float,
    view: View | None = None,
    network_holder: bool = False,
    memory_mb: int = 0,
) -> int:
    """Run the replica ``name`` (or, with ``network_holder``, the holder of the run's network
    namespace) until it ends, is stopped, or its supervisor is gone."""
    stop_requested = []
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop_requested.append(True))
    paths = RunPaths(run_dir)
    # The holder is no replica: its log sits with the keepers' records, not among the replicas' logs.
    log_file = open((paths.replicas if network_holder else paths.logs) / f"{name}.log", "ab")
    bounds = None
    if network_holder:
        replica = netns.hold(run_dir, log_file, replica_environment())
    else:
        command = [sys.executable, "-m", "hetflow.replica", "--run-dir", str(run_dir)]
        # Limits come with the sandbox: an unisolated replica runs as the operator allowed, unbounded.
        bounds = _replica_limits(run_dir, name, memory_mb, log_file) if view is not None and os.geteuid() == 0 else None
        replica = _launch(command, view, run_dir, log_file, core, bounds)
    throttle = Throttle(replica.pid, slowdown) if slowdown > 1 else None
    if throttle:
        throttle.start()
    supervision = Supervision(time.monotonic(), ["lease"])
    while replica.poll() is None:
        lost = supervision.gone(time.monotonic(), lease_held=supervisor_holds_lease(run_dir)) is not None
        if throttle and (lost or stop_requested or time.time() > deadline):
            throttle.stop()  # a stopped process would not see SIGTERM
        if lost:
            signal_group(replica.pid, signal.SIGKILL)
        elif stop_requested or time.time() > deadline:
            _terminate(replica)
        try:
            # Short: a SIGTERM is acted on only when this returns, and teardown waits for it.
            replica.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
    code = replica.returncode
    target = exit_path(run_dir, name)
    scratch = target.with_suffix(".exit.tmp")
    scratch.write_text(json.dumps({"exit_code": code}))
    scratch.replace(target)  # atomically: the supervisor never reads half a record
    if bounds is not None:
        bounds.remove()
    return 0


def _replica_limits(run_dir: Path, name: str, memory_mb: int, log_file) -> limits.ReplicaLimits:
    """The replica's cgroups; where none can be made here (a cgroup v2 or read-only hierarchy), an
    rlimit on its tasks instead, and its log's first line says so and why."""
    try:
        return limits.make(run_dir, name, memory_mb)
    except (limits.LimitsUnavailable, OSError) as unavailable:
        rlimits = limits.ReplicaRlimits(memory_mb)
        log_file.write(f"hetflow keeper: {name} has no cgroup ({unavailable}): limited to {rlimits}\n".encode())
        log_file.flush()
        return rlimits


def _terminate(replica: subprocess.Popen) -> None:
    signal_group(replica.pid, signal.SIGTERM)
    try:
        replica.wait(timeout=TERM_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        signal_group(replica.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--name", required=True, help="the replica, e.g. worker-0")
    parser.add_argument("--core", type=int, help="pin the replica to this CPU core")
    parser.add_argument("--slowdown", type=float, default=1.0, help="give it 1/slowdown of the CPU time")
    parser.add_argument("--memory-mb", type=int, default=0, help="its memory limit in MiB (0: none)")
    parser.add_argument("--deadline", type=float, required=True, help="stop it at this time (epoch seconds)")
    parser.add_argument("--network-holder", action="store_true", help="hold the run's network namespace instead")
    parser.add_argument("--unisolated", action="store_true", help="run the replica without a sandbox")
    parser.add_argument("--rw", action="append", default=[], help="a directory the replica may write")
    parser.add_argument("--ro", action="append", default=[], help="a directory (or file) it may read")
    parser.add_argument("--hide", action="append", default=[], help="a directory hidden under a shown one")
    args = parser.parse_args(argv)
    view = None if args.unisolated else View(args.rw, args.ro, args.hide)
    return keep(
        args.run_dir,
        args.name,
        args.core,
        args.slowdown,
        args.deadline,
        view,
        args.network_holder,
        args.memory_mb,
    )


if __name__ == "__main__":
    sys.exit(main())

"""What the docker, swarm and kubernetes backends share: each replica's declared needs
(``ReplicaSpec``), its environment, and the engine's log stream turned into lines and the
replica's log file."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterable, Iterator, Literal

from hetflow import sandbox
from hetflow.cluster.layout import ClusterLayout, Replica
from hetflow.cluster.processes import RUN_ID_ENV
from hetflow.cluster.replica_view import (
    hand_over_writable,
    provisioned_directories,
    remove_what_replicas_planted,
)
from hetflow.paths import RunPaths
from hetflow.spec import RunSpec

# Processes a replica may run: TensorFlow's thread pools count, a fork bomb does not get far.
PIDS_LIMIT = 1024

# A replica's /tmp, on every backend: the one place it writes besides its output folder on a
# read-only root file system (HOME is there: matplotlib and TFDS cache under it).
TMP_BYTES = 512 * 2**20

# Grace between SIGTERM and SIGKILL when stopping a replica: a TF worker waiting for a peer
# ignores SIGTERM (see the local backend), so the engine's escalation is what ends it.
STOP_GRACE_SECONDS = 10


@dataclass(frozen=True)
class ReplicaLaunch:
    """One replica of a run as an engine launches it (a docker container, a swarm service).

    :param home: HETFLOW_HOME; the run directory and the data dir (the spec's, or the one under
        ``home``) are mounted at the same paths.
    :param run_dir: the run directory (under ``home``).
    :param user: ``uid:gid`` the replica runs as (``container_user``).
    :param launched_at: when the supervisor launched the run (for time to first step).
    """

    layout: ClusterLayout
    replica: Replica
    spec: RunSpec
    home: Path
    run_dir: Path
    user: str
    launched_at: float

    def __iter__(self):
        """Its fields in order, as they are (``dataclasses.astuple`` would copy the layout into tuples)."""
        return iter(getattr(self, field.name) for field in fields(self))


@dataclass(frozen=True)
class ReplicaSpec:
    """What one replica needs, declared once and read by every container backend — as a TFJob's
    ``tfReplicaSpecs`` declares each replica type (image, resources, restart policy), resolved per
    replica because the workers of a heterogeneous cluster differ (device, slowdown, node).

    :param cpus: CPU limit and reservation (0: none); a slowed worker's is smaller.
    :param memory_mb: memory limit and reservation in MiB (0: none).
    :param gpus: GPUs to request; the replica computes on exactly these.
    :param device: what it computes on (``gpu`` or ``cpu``); a chief or ps computes nothing.
    :param node: the machine it must run on, by name (swarm), or None.
    :param restart_policy: never, on_failure or exit_code; the supervisor carries it out.
    """

    image: str
    cpus: float
    memory_mb: int
    gpus: int
    device: Literal["cpu", "gpu"]
    node: str | None
    restart_policy: str


def replica_spec(spec: RunSpec, replica: Replica) -> ReplicaSpec:
    worker = spec.cluster.worker_device(replica.index) if replica.role == "worker" else None
    return ReplicaSpec(
        image=spec.cluster.image,
        cpus=replica_cpus(spec, replica),
        memory_mb=spec.cluster.resources.memory_mb,
        gpus=replica_gpus(spec, replica),
        device=worker.device if worker else "cpu",
        node=worker.node if worker else None,
        restart_policy=spec.cluster.run_policy.restart_policy,
    )


def container_user(run_dir: Path) -> str:
    """``uid:gid`` the container replicas of the run in ``run_dir`` run as: the supervisor's own, so
    that what they write is the reader's; where the supervisor is root, the run's own unprivileged uid
    (``sandbox.run_owner``, as its local replicas would have), so that no other run's replicas and no
    host process running as ``nobody`` own its files."""
    if os.geteuid() == 0:
        return "{}:{}".format(*sandbox.run_owner(run_dir))
    return f"{os.getuid()}:{os.getgid()}"


def prepare_run_dir(paths: RunPaths, owner: tuple[int, int] | None = None) -> None:
    """Before container replicas start: remove what an earlier try's replicas planted in their output
    folder, make the folders their mounts need (an engine would make a missing one as root), and hand
    the output folder to their uid and gid (``owner``; the run's own by default)."""
    remove_what_replicas_planted(paths.root)
    for directory in provisioned_directories(paths):
        directory.mkdir(parents=True, exist_ok=True)
    hand_over_writable(paths, owner or sandbox.run_owner(paths.root))


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


def replica_cpus(spec: RunSpec, replica: Replica) -> float:
    """The replica's CPU quota (0: none). A worker's slowdown is a quota: a worker ``slowdown``
    times slower gets 1/slowdown of what the others get (``replica_cpus``, or one core where
    that is unset), enforced by the kernel's CFS quota, not by stopping and resuming it."""
    slowdown = spec.cluster.worker_device(replica.index).slowdown if replica.role == "worker" else 1.0
    if slowdown > 1:
        return (spec.cluster.resources.cpus or 1.0) / slowdown
    return spec.cluster.resources.cpus


def replica_gpus(spec: RunSpec, replica: Replica) -> int:
    """GPUs to request for the replica: a GPU worker's own count (``RunSpec.worker_device``, what
    the replica itself uses); none for a CPU worker, a ps or the chief of parameter_server (it
    only schedules steps)."""
    if not spec.cluster.resources.request_gpus or replica.role != "worker":
        return 0
    device = spec.cluster.worker_device(replica.index)
    return device.count if device.device == "gpu" else 0


def open_log(log_path: Path):
    """The replica's log file, opened to append without following a link at its name (the pipeline
    writes it; whatever a replica put there is not where its output goes)."""
    descriptor = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    return os.fdopen(descriptor, "a", encoding="utf-8")


def lines_to_file(chunks: Iterable[bytes], log_path: Path) -> Iterator[str]:
    """The replica's output, as the engine streams it in arbitrary chunks, line by line; each line
    is also appended to its log file."""
    pending = b""
    with open_log(log_path) as log_file:
        for chunk in chunks:
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for raw in complete:
                line = raw.decode("utf-8", "replace").rstrip()
                log_file.write(line + "\n")
                log_file.flush()
                yield line
        if pending:
            line = pending.decode("utf-8", "replace").rstrip()
            log_file.write(line + "\n")
            yield line

"""Memory and task limits of one local replica, what its cgroup gives a container: a cgroup of its own
in cgroup v1's ``memory`` and ``pids`` hierarchies (``hetflow/<run dir>-<replica>``), with at most
``REPLICA_TASKS`` processes and threads and, where the spec sets ``replica_memory_mb``, that much
memory (the kernel's OOM killer ends it past that, as Docker's ``--memory`` does).

Made by the keeper (root) before the replica starts and entered by the replica before exec, so that
bubblewrap and everything it starts are inside; removed when the replica has ended. Where no cgroup
can be made (no writable v1 hierarchy: a cgroup v2 host, where hetflow does not write cgroups yet),
``make`` says why in one line, and the keeper limits the replica's tasks with an rlimit instead
(``ReplicaRlimits``; its memory is then not limited), that line first in its log.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# TensorFlow's threads with room to spare (a 2-worker run holds about 60 each); a fork bomb stops here.
REPLICA_TASKS = 1024


class LimitsUnavailable(RuntimeError):
    """No cgroup can be made for a replica here."""


@dataclass(frozen=True)
class ReplicaCgroups:
    """The cgroups of one replica: entered before exec, removed once it has ended."""

    directories: tuple[Path, ...]

    def enter(self) -> None:
        """Move the calling process into them (a preexec: what it execs, and its children, stay in)."""
        for directory in self.directories:
            (directory / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self, patience: float = 5.0) -> None:
        """Remove them once the last task has left (the kernel frees a dying task's slot shortly after)."""
        deadline = time.monotonic() + patience
        for directory in self.directories:
            while directory.exists():
                try:
                    directory.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)


def make(run_dir: Path, name: str, memory_mb: int, root: Path | None = None) -> ReplicaCgroups:
    """The replica ``name``'s cgroups, with its limits set; LimitsUnavailable, one line, where none can be made."""
    made = []
    for controller in ("pids", "memory"):
        hierarchy = (root or CGROUP_ROOT) / controller
        if not os.access(hierarchy, os.W_OK):
            raise LimitsUnavailable(f"no writable cgroup v1 {controller} hierarchy at {hierarchy} to limit {name}")
        directory = hierarchy / "hetflow" / f"{Path(run_dir).name}-{name}"
        directory.mkdir(parents=True, exist_ok=True)
        made.append(directory)
    pids, memory = made
    (pids / "pids.max").write_text(str(REPLICA_TASKS))
    if memory_mb:
        (memory / "memory.limit_in_bytes").write_text(str(memory_mb * 2**20))
    return ReplicaCgroups(tuple(made))


@dataclass(frozen=True)
class ReplicaRlimits:
    """Where no cgroup can be made: the run's uid, which only its replicas run as, under
    ``REPLICA_TASKS`` processes and threads (RLIMIT_NPROC, set on the replica's first process and
    inherited by bubblewrap and everything it starts; the run's replicas share the count). Memory
    stays unlimited: an rlimit bounds address space (RLIMIT_DATA counts every thread's stack), which
    TensorFlow reserves far beyond what it uses: two workers of the MLP under a 1500 MiB RLIMIT_DATA
    could not create their threads (pthread_create: EAGAIN)."""

    memory_mb: int  # what the spec asked for, which this cannot enforce

    def enter(self) -> None:
        """Set the limit on the calling process (a preexec, as root: it holds once it is the run's uid)."""
        resource.setrlimit(resource.RLIMIT_NPROC, (REPLICA_TASKS, REPLICA_TASKS))

    def remove(self) -> None:
        """Nothing: the limit ends with the processes."""

    def __str__(self) -> str:
        memory = f"replica_memory_mb={self.memory_mb} is not enforced" if self.memory_mb else "memory unlimited"
        return f"{REPLICA_TASKS} tasks for the run's uid (RLIMIT_NPROC); {memory} without a cgroup"


ReplicaLimits = ReplicaCgroups | ReplicaRlimits

"""Memory and task limits of one local replica, what its cgroup gives a container: a cgroup of its own
in cgroup v1's ``memory`` and ``pids`` hierarchies (``hetflow/<run dir>-<replica>``), with at most
``REPLICA_TASKS`` processes and threads and, where the spec sets ``replica_memory_mb``, that much
memory (the kernel's OOM killer ends it past that, as Docker's ``--memory`` does).

Made by the keeper (root) before the replica starts and entered by the replica before exec, so that
bubblewrap and everything it starts are inside; removed when the replica has ended. Where no cgroup
can be made (not root, no writable v1 hierarchy: cgroup v2 is not written yet), ``make`` says why in
one line, and the keeper runs the replica without limits, that line first in its log.
"""

from __future__ import annotations

import os
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

"""Which process provisioned a run's replicas: ``provisioned_by.json`` in the run directory names it
(pid, start time, host), so that ``hetflow run``, interrupted, tears down the runs it provisioned
itself, and no other process's: its DAG's teardown task will not run."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from hetflow.cluster.processes import start_ticks
from hetflow.paths import NotRegularFile, RunPaths, read_regular, read_replica_record, write_record


def this_process() -> dict:
    """This process, named so that no other one matches: a pid is reused, a pid and the clock ticks
    from boot to its start (field 22 of /proc/self/stat) on one host are not."""
    pid = os.getpid()
    return {"pid": pid, "start_time": start_ticks(pid), "host": socket.gethostname()}


def record_provisioner(paths: RunPaths) -> None:
    """Name this process as the one that provisions the run: before any replica starts, so that a
    run provisioned halfway is torn down too."""
    write_record(paths.provisioned_by, this_process())


def provisioned_here(home: Path) -> list[str]:
    """The ids of the runs under ``home`` whose replicas this process provisioned."""
    here = this_process()
    found = []
    for root in sorted((home / "runs").iterdir()) if (home / "runs").is_dir() else []:
        paths = RunPaths(root)
        try:
            if read_replica_record(paths.provisioned_by) == here:
                found.append(read_regular(paths.owner, 4096).decode())
        except (OSError, NotRegularFile):  # not provisioned (yet), or by no process of this hetflow
            continue
    return found

"""What every backend shows a replica of this host, and what it takes back before the pipeline reads:
the run directory read-only, the replica's output folder alone read-write, its run's dataset alone;
the output folder handed to the replicas' uid; what a replica planted there removed."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from hetflow import sandbox
from hetflow.data.prepare import shown_to_replicas
from hetflow.paths import NotRegularFile, RunPaths, data_dir, entries_under, planted, read_replica_record
from hetflow.spec import RunSpec

log = logging.getLogger("hetflow.cluster")


def replica_view(spec: RunSpec, run_dir: Path, home: Path) -> dict[str, list[Path]]:
    """What of HETFLOW_HOME a replica sees, on every backend: its run directory read-only as a whole,
    its output folder (``RunPaths.output``) alone read-write, and its run's prepared dataset alone
    (``hetflow.data.prepare.shown_to_replicas``: not every run's data), read-only, at the resolved path
    it was prepared and checked at in the spec's data dir (or the one under ``home``); refused, one
    line, where that path leads elsewhere now. A folder read-only as a whole stays so for what the
    pipeline renames into it later, where a read-only bind of one file is lost with the file."""
    data = Path(spec.data.data_dir) if spec.data.data_dir else data_dir(home)
    return {"read_write": [RunPaths(run_dir).output], "read_only": [run_dir, *shown_to_replicas(run_dir, data)]}


def provisioned_directories(paths: RunPaths) -> list[Path]:
    """The folders made before any replica starts: where the pipeline writes how they run (their logs,
    ``replicas/``) and the replicas' output folder, which their mounts need to exist."""
    return [paths.logs, paths.replicas, paths.output]


def hand_over_writable(paths: RunPaths, owner: tuple[int, int] = sandbox.SANDBOX_OWNER) -> None:
    """The output folder (``RunPaths.output``: the chief's weights and records, the checkpoints) and
    what it holds become the replicas' own (``owner``: their uid and gid, the sandbox's by default)
    where root provisions; the run directory stays the pipeline's. Replicas of the run may be live (a
    restart's peers): what is in the folder is changed by name relative to its folder's descriptor,
    never through a link."""
    paths.output.mkdir(exist_ok=True)  # in the pipeline's read-only folder: no replica put a link here
    with contextlib.suppress(FileExistsError):  # a replica's link there is neither followed nor entered
        paths.checkpoints.mkdir()
    if os.geteuid() == 0:  # as any other user the sandbox writes as that user: nothing to hand over
        for entry in entries_under(paths.output):
            with contextlib.suppress(FileNotFoundError):  # moved since it was listed: it is not handed over
                os.chown(entry.name, *owner, dir_fd=entry.directory_fd, follow_symlinks=False)
    sandbox.hand_over(paths.output, owner)


def remove_what_replicas_planted(run_dir: Path) -> list[Path]:
    """Remove from the replicas' output folder (the only one they write) what the pipeline would
    otherwise read through: every link, fifo, socket or device node (TensorFlow and the replica code
    make none), and a replica's JSON record that is not a bounded JSON object. Each is named in a
    warning; returns them. Live replicas may swap a folder for a link meanwhile: each name is removed
    relative to its folder's descriptor, and a folder swapped for a link is not entered
    (``paths.entries_under``)."""
    paths = RunPaths(run_dir)
    removed = []
    for entry in entries_under(paths.output):
        if planted(entry.mode):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):  # replaced since: not planted
                os.unlink(entry.name, dir_fd=entry.directory_fd)
                removed.append(entry.path)
    for record in (paths.training, paths.plan):
        if record.exists() and record not in removed:
            try:
                read_replica_record(record)
            except NotRegularFile as refused:
                log.warning("%s", refused)
                record.unlink()
                removed.append(record)
    for path in removed:
        log.warning("removed %s, which a replica left (the pipeline reads regular files only)", path)
    return removed

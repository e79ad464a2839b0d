"""The run's network namespace: where a run's local replicas listen, with only loopback up, so that
they reach each other on its 127.0.0.1 and nothing outside reaches them (TensorFlow's gRPC servers
listen on every interface, unauthenticated, and run graph ops for whoever connects).

bubblewrap makes a namespace per sandbox and cannot join one, so the run's namespace is kept by a
holder: a sandbox that only sleeps (``hetflow.sandbox.holder_command``), run by a keeper like a
replica (``hetflow.cluster.backends.local.keeper --network-holder``), which records in ``replicas/network.json``
(where replicas cannot write) the holder's pid and the identity of its user and network
namespaces. Each replica's sandbox enters that user and network namespace first (``join``): the
uid that made them may, and no other can. No root needed, nothing named on the host: the kernel
frees the namespace when its last process is gone.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from pathlib import Path

from hetflow import sandbox
from hetflow.paths import RunPaths, write_record

HOLDER_START_SECONDS = 30.0


class NetworkGone(RuntimeError):
    """The run's network holder is not running (any more)."""


def record_path(run_dir: Path) -> Path:
    """Where the holder of the run's namespace is recorded."""
    return RunPaths(run_dir).replicas / "network.json"


def _namespace(pid: int, kind: str) -> int:
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino


def hold(run_dir: Path, log_file, env: dict[str, str]) -> subprocess.Popen:
    """Start the holder of the run's network namespace (a process group of its own) and record
    where it is; returns it once the record is written."""
    read, write = os.pipe()
    try:
        holder = subprocess.Popen(
            sandbox.holder_command(write, sandbox.run_owner(run_dir)),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=[write],
        )
        os.close(write)
        write = None
        info = _read_info(read, holder)
    finally:
        os.close(read)
        if write is not None:
            os.close(write)
    pid = info["child-pid"]
    namespaces = {kind: _namespace(pid, kind) for kind in ("user", "net")}
    write_record(record_path(run_dir), {"pid": pid, **namespaces})
    return holder


def _read_info(fd: int, holder: subprocess.Popen) -> dict:
    """bwrap's ``--info-fd`` JSON; the sleeping holder keeps the pipe open, so read until it parses."""
    text, deadline = b"", time.monotonic() + HOLDER_START_SECONDS
    while time.monotonic() < deadline:
        try:
            return json.loads(text)
        except ValueError:
            pass
        if holder.poll() is not None:
            raise NetworkGone(f"the network holder exited with code {holder.returncode} before it started")
        if select.select([fd], [], [], 0.2)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            text += chunk
    try:
        return json.loads(text)
    except ValueError:
        raise NetworkGone(f"the network holder said nothing in {HOLDER_START_SECONDS:.0f} s") from None


def join(run_dir: Path) -> tuple[int, int]:
    """Open descriptors of the holder's user and network namespaces, checked against its record
    (a pid reused by another process gives other namespaces, and is refused)."""
    try:
        record = json.loads(record_path(run_dir).read_text())
    except FileNotFoundError:
        raise NetworkGone(f"{run_dir.name} has no network holder ({record_path(run_dir).name} is missing)")
    opened = []
    try:
        for kind in ("user", "net"):
            fd = os.open(f"/proc/{int(record['pid'])}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
            opened.append(fd)
            if os.fstat(fd).st_ino != record[kind]:
                raise NetworkGone(f"the network holder of {run_dir.name} is gone (its pid is another process's)")
    except FileNotFoundError:
        raise NetworkGone(f"the network holder of {run_dir.name} is gone (no process {record['pid']})") from None
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    return opened[0], opened[1]


def namespace_of(pid: int) -> int:
    """The network namespace a process is in (its inode), to compare with the holder's."""
    return _namespace(pid, "net")

"""``unshare --mount --propagation private -- python confine.py [--hide DIR] [--rw DIR] [--ro DIR] -- COMMAND...``

Runs COMMAND in a view of the file system it cannot change: every mount read-only, each ``--hide``
directory replaced by an empty one, the ``--rw`` and ``--ro`` directories (which may lie under a
hidden one) shown at their own paths, a private /tmp and /dev/shm, and no capabilities left
(COMMAND stays uid 0, but without CAP_SYS_ADMIN it can neither remount nor unmount, and without
CAP_DAC_OVERRIDE or ptrace rights it reads no other process's memory or environment).

For processes the pipeline starts that run what others wrote: a replica (its code is ours, but its
gRPC server takes graph ops from its peers) sees its run directory and the prepared data, not
other runs, the dataset cache or the stack's secrets; the model server of the served check, which
loads a registered model (and so may run its code), sees the model and nothing of the pipeline.

Run as root, after ``unshare`` gave the process a mount namespace of its own: the mounts below
change nothing outside it. Standard library only: the model server runs it without hetflow on
its path.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import sys
from pathlib import Path

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 32, 4096, 1024, 2048, 1 << 21
_KEPT_OPTIONS = {
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": _MS_NOATIME,
    "nodiratime": _MS_NODIRATIME,
    "relatime": _MS_RELATIME,
}
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 24, 38
# Kernel file systems stay as they are: /proc and /sys are needed read-write by nothing we run, but
# remounting them is refused or breaks /dev's device nodes.
_KERNEL_MOUNTS = ("/proc", "/sys", "/dev")
# Replaced by empty private ones (a tmpfs each): what the command writes there goes with it.
_SCRATCH = ("/tmp", "/dev/shm")

_libc = ctypes.CDLL(None, use_errno=True)


def _call(name: str, *args) -> None:
    if getattr(_libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}{args}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    _call("mount", encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data))


def _mounts() -> list[tuple[str, str]]:
    """(mount point, its per-mount options) of every mount in this namespace, parents first."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        # Mount points escape space, tab, newline and backslash as octal; other characters (UTF-8
        # included) are as they are.
        point = re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape[1], 8)), fields[4])
        mounts.append((point, fields[5]))
    return mounts


def _under(path: str, directories) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in directories)


def confine(hide: list[str], read_write: list[str], read_only: list[str]) -> None:
    # Opened before anything is covered: a hidden directory's contents are reachable afterwards
    # only this way.
    shown = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in read_write + read_only}
    hide = [directory for directory in hide if os.path.isdir(directory)]  # none is created on the host
    scratch = list(_SCRATCH)
    # Parents first: a directory shown inside a hidden one, or hidden inside a shown one, is mounted
    # over what its parent's mount put there, never covered by it.
    for path in sorted([*scratch, *hide, *shown], key=lambda p: len(Path(p).parts)):
        os.makedirs(path, exist_ok=True)  # in a tmpfs mounted above, when the path lies under one
        if path in shown:
            _mount(f"/proc/self/fd/{shown[path]}", path, None, _MS_BIND)
            os.close(shown[path])
        else:
            _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777" if path in scratch else "mode=755")
    writable = {*read_write, *scratch}
    for point, options in _mounts():
        if point in writable or _under(point, _KERNEL_MOUNTS) and point not in scratch:
            continue
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID
        for option in options.split(","):
            flags |= _KEPT_OPTIONS.get(option, 0)
        _mount(None, point, None, flags)


def drop_capabilities() -> None:
    """Empty the bounding set: at the exec that follows, uid 0 gets no capabilities; nothing
    (setuid binaries, file capabilities) can give any back."""
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    for capability in range(int(Path("/proc/sys/kernel/cap_last_cap").read_text()) + 1):
        _prctl(_PR_CAPBSET_DROP, capability)


def _prctl(option: int, argument: int) -> None:
    _call("prctl", option, *(ctypes.c_ulong(value) for value in (argument, 0, 0, 0)))


def unavailable() -> str | None:
    """Why commands cannot be confined here (None: they can)."""
    if os.geteuid() != 0:
        return "not running as root, which a mount namespace needs"
    if shutil.which("unshare") is None:
        return "no `unshare` (util-linux) command on PATH"
    return None


def user_home() -> list[str]:
    """This user's home directory, to hide (its keys and tokens), unless it is / (a container's)."""
    home = os.path.realpath(os.path.expanduser("~"))
    return [] if home == "/" else [home]


def confined(command: list[str], hide=(), read_write=(), read_only=(), working_directory=None) -> list[str]:
    """``command`` as run by this script in a mount namespace of its own (see the module's doc),
    in ``working_directory`` (default: the caller's, as it looks there)."""
    # The code, the venv and the interpreter's own install stay visible (read-only) wherever they
    # are: a hidden HETFLOW_HOME or home, or the private /tmp, must not hide what the command runs
    # (a checkout under /tmp did: the replica's interpreter was not found).
    code = [str(Path(__file__).resolve().parents[1]), *map(os.path.realpath, (sys.prefix, sys.base_prefix))]
    for path in code:
        if _under(path, [*hide, *_SCRATCH]) and not _under(path, [*read_write, *read_only]):
            read_only = [*read_only, path]
    views = (("hide", hide), ("rw", read_write), ("ro", read_only))
    options = [f"--{flag}={path}" for flag, paths in views for path in paths]
    options += [f"--cwd={working_directory}"] if working_directory else []
    return ["unshare", "--mount", "--propagation", "private", "--", sys.executable, __file__, *options, "--", *command]


def main(argv: list[str]) -> None:
    if "--" not in argv:
        raise SystemExit("usage: confine.py [--hide DIR] [--rw DIR] [--ro DIR] -- COMMAND...")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="confine.py")
    parser.add_argument("--hide", action="append", default=[])
    parser.add_argument("--rw", action="append", default=[])
    parser.add_argument("--ro", action="append", default=[])
    parser.add_argument("--cwd")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    confine(args.hide, args.rw, args.ro)
    # The working directory is looked up again in the new view: one under a hidden directory would
    # otherwise stay a way into what the tmpfs covers (``..`` walks the directory underneath).
    try:
        os.chdir(args.cwd or os.getcwd())
    except FileNotFoundError:
        if args.cwd:
            raise
        os.chdir("/")
    drop_capabilities()
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Running what others wrote — a local replica, a registered model's server — under bubblewrap
(Debian's ``bubblewrap``, Flatpak's sandbox), never as we are.

A sandboxed command runs as a non-zero uid with no capabilities, in user, mount, pid, ipc and uts
namespaces of its own, and in a network namespace that is either its own (only loopback) or the
one its run's replicas share (``hetflow.cluster.backends.local.netns``). Its file system is built from nothing:
the system's ``/usr`` and ``/etc`` (less the password hashes), a fresh ``/proc``, ``/dev`` and
``/tmp``, and only the directories it is shown (the code, the interpreter, a run directory, the
data). Nothing else exists there: no ``/run`` (the Docker socket), no home, no other run, no
HETFLOW_HOME beyond what it is shown. It dies with the process that started it
(``--die-with-parent``).

Started by root, the command first drops to an unprivileged uid (``setpriv``): each run's replicas
to a uid of their own (``run_owner``), so that no other run's process and no host user's can
signal, trace or write them or their files; other sandboxes (a model server) to ``SANDBOX_UID``.
It holds no supplementary group, loads the container tools' default seccomp profile (``hetflow.seccomp``:
no ``unshare``, ``setns``, ``mount``, ``keyctl``, ``bpf``, ...) and may make no user namespace
(``--disable-userns``). A user namespace made
by root maps its sandbox uid to root outside, which the kernel still treats as root (such a
process can open ``/proc/sys/kernel/core_pattern`` for writing). bwrap resolves what it shows
as the uid it runs as, and root's files (an interpreter under /root, pytest's /tmp/pytest-of-root)
are out of the dropped uid's reach, so root first runs bwrap itself, with no user namespace, to
make a view holding only the system and the shown directories (their parents traversable), and
drops to the sandbox uid inside it, where an unprivileged bwrap makes the sandbox.

Where no sandbox can be had (no bwrap, user namespaces disabled), a run is refused unless this
machine's operator sets ``HETFLOW_ALLOW_UNISOLATED=1`` (off by default; not a form field: who
triggers a run must not be able to switch the sandbox off).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hetflow import seccomp
from hetflow.paths import REPO_ROOT, hetflow_home

log = logging.getLogger("hetflow.sandbox")

ALLOW_UNISOLATED_ENV = "HETFLOW_ALLOW_UNISOLATED"
# What root drops to outside a run (a model server): nobody owns no file, holds no group and no capability.
SANDBOX_UID = SANDBOX_GID = 65534
SANDBOX_OWNER = (SANDBOX_UID, SANDBOX_GID)
# Where runs' uids are drawn from: above the users and the subordinate ranges of /etc/subuid, in the
# block systemd leaves unused (0x70000000-0x7FFEFFFF); no passwd entry is needed. Two runs share one
# with a chance of 1 in RUN_UIDS.
RUN_UID_BASE = 0x7000_0000
RUN_UIDS = 1 << 24
# What root's view needs beyond the sandbox's: dropping to the sandbox uid.
_SETPRIV_CAPABILITIES = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")


class SandboxUnavailable(RuntimeError):
    """No sandbox can be had here and running unisolated was not accepted."""


def run_owner(run_dir: Path | str) -> tuple[int, int]:
    """The uid and gid of a run's replicas (and of what they write), drawn from its run directory."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).digest()
    uid = RUN_UID_BASE + int.from_bytes(digest[:8], "big") % RUN_UIDS
    return uid, uid


def _drop_privileges(owner: tuple[int, int]) -> list[str]:
    """The prefix that makes root an unprivileged uid with no capabilities and no groups."""
    if os.geteuid() != 0:
        return []
    return [
        "setpriv",
        f"--reuid={owner[0]}",
        f"--regid={owner[1]}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


def _system_view() -> list[str]:
    """The system part of every sandbox's file system, read-only: /usr, /etc (whose secrets, the
    password hashes and host keys, only root reads) and the top-level links (or directories) a
    merged-/usr system points into /usr."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    return [*args, "--ro-bind", "/etc", "/etc"]


@functools.cache
def unavailable() -> str | None:
    """Why no sandbox can be had here (None: one can): tried once per process with a real one."""
    if shutil.which("bwrap") is None:
        return "no `bwrap` on PATH (Debian's bubblewrap package)"
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "running as root and no `setpriv` (util-linux) to drop to an unprivileged uid"
    box = Sandbox()
    try:
        trial = box.command(["true"])
        done = subprocess.run(trial, pass_fds=box.fds, capture_output=True, text=True, timeout=30)
    except seccomp.SeccompUnavailable as error:
        return str(error)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"bubblewrap did not start: {error}"
    finally:
        box.close()
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        return f"bubblewrap cannot make a sandbox here: {lines[-1]}"
    return None


def required(what: str) -> bool:
    """Whether ``what`` (e.g. "the replicas of run X") runs sandboxed: True where a sandbox can be
    had; False, with a warning, where none can and the operator accepted running unisolated; else
    SandboxUnavailable, one line saying why and which setting accepts it."""
    reason = unavailable()
    if reason is None:
        return True
    if os.environ.get(ALLOW_UNISOLATED_ENV) == "1":
        log.warning("%s run unisolated, as this machine's %s=1 accepts (%s)", what, ALLOW_UNISOLATED_ENV, reason)
        return False
    raise SandboxUnavailable(
        f"{what} cannot be sandboxed here ({reason}); install bubblewrap, or set "
        f"{ALLOW_UNISOLATED_ENV}=1 to accept running them unisolated as this user"
    )


def private_directories(tracking_uri: str | None = None) -> list[str]:
    """What no sandbox may see even where a directory it is shown holds it: HETFLOW_HOME (other
    runs, the stack's secrets), the MLflow store's folder (``tracking_uri``'s, default this
    process's, and the checkout's default one), Airflow's home, the user's home."""
    private = [hetflow_home(), REPO_ROOT / "mlflow"]
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith("sqlite:///"):
        private.append(Path(uri.removeprefix("sqlite:///")).parent)
    if "AIRFLOW_HOME" in os.environ:
        private.append(Path(os.environ["AIRFLOW_HOME"]))
    home = Path(os.path.expanduser("~"))
    private += [] if home.resolve() == Path("/") else [home]
    return sorted({str(path.resolve()) for path in private})


def hand_over(path: Path | str, owner: tuple[int, int] = SANDBOX_OWNER) -> None:
    """Make ``path`` (a directory the sandbox writes into) the sandbox uid's (or ``owner``'s: uid,
    gid), where root starts it; as any other user the sandbox writes as that user and nothing changes."""
    if os.geteuid() == 0:
        os.chown(path, *owner, follow_symlinks=False)


@dataclass
class Sandbox:
    """One sandboxed command line: ``Popen(sandbox.command(argv), pass_fds=sandbox.fds)``, then
    ``close()``.

    :param read_write: directories shown writable, at their own paths.
    :param read_only: directories (or files) shown read-only, at their own paths.
    :param hidden: directories under a shown one replaced by an empty one (a HETFLOW_HOME inside
        the checkout); a shown directory under a hidden one is shown again.
    :param network: ``"own"`` (a network namespace of its own, only loopback) or the open
        descriptors ``(user namespace, network namespace)`` of the run's network holder to join.
    :param owner: the uid and gid root drops to (a run's replicas: ``run_owner``; the holder of the
        network it joins must run as the same).
    """

    read_write: list[str] = field(default_factory=list)
    read_only: list[str] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)
    network: str | tuple[int, int] = "own"
    working_directory: str = "/tmp"
    fds: list[int] = field(default_factory=list)
    owner: tuple[int, int] = SANDBOX_OWNER

    def _shown(self) -> list[tuple[str, str]]:
        """(option, path) of every directory shown: the code and the interpreter too, wherever
        they are, read-only."""
        interpreter = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
        code = [str(REPO_ROOT), *sorted(path for path in interpreter if not _under(path, ["/usr"]))]  # /usr is shown
        shown = [("--bind", path) for path in self.read_write]
        read_only = [path for path in dict.fromkeys([*self.read_only, *code]) if path not in self.read_write]
        # Parents first, here and in root's view: a directory shown inside another is mounted over
        # its parent's mount, never covered by it.
        return sorted(shown + [("--ro-bind", path) for path in read_only], key=lambda entry: len(Path(entry[1]).parts))

    def command(self, argv: list[str]) -> list[str]:
        shown = self._shown()
        shown_paths = [path for _, path in shown]
        hidden = [
            ("--tmpfs", path)
            for path in self.hidden
            if os.path.isdir(path) and _under(path, shown_paths) and path not in shown_paths
        ]
        args = ["bwrap", "--unshare-user", "--disable-userns", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        args += ["--unshare-cgroup-try", *(["--unshare-net"] if self.network == "own" else [])]
        self.fds.append(seccomp.program_descriptor())
        args += ["--seccomp", str(self.fds[-1])]
        args += ["--die-with-parent", *_system_view(), "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for option, path in sorted([*shown, *hidden], key=lambda entry: len(Path(entry[1]).parts)):
            args += [option, path] if option == "--tmpfs" else [option, path, path]
        args += ["--remount-ro", "/", "--chdir", self.working_directory, "--", *argv]
        if self.network != "own":
            user, net = self.network
            self.fds += [user, net]
            # Joining the holder's user namespace (made by the same uid) is what gives the right to
            # enter its network namespace; bwrap then nests a user namespace of its own.
            nsenter = [
                "nsenter",
                "--preserve-credentials",
                f"--user=/proc/self/fd/{user}",
                f"--net=/proc/self/fd/{net}",
            ]
            args = [*nsenter, "--", *args]
        if os.geteuid() != 0:
            return args
        return [*self._root_view(shown), *_drop_privileges(self.owner), *args]

    @staticmethod
    def _root_view(shown: list[tuple[str, str]]) -> list[str]:
        """bwrap as root, no user namespace: a view of the system and the shown directories, their
        parents created traversable, where the sandbox uid can reach what it is shown."""
        paths = [path for _, path in shown]
        parents = sorted(
            {str(parent) for path in paths for parent in Path(path).parents if not _under(str(parent), paths)}
            - {"/", "/tmp"},
            key=lambda parent: len(Path(parent).parts),
        )
        # bwrap makes its new root on /tmp, which it must find there. A pid namespace of its own: the
        # dropped uid is out of reach of a parent-death signal from root's bwrap (sending one takes
        # CAP_KILL, which bwrap drops), but when its init dies the kernel ends all in it.
        args = ["bwrap", "--unshare-pid", "--die-with-parent", *_system_view(), "--tmpfs", "/tmp"]
        args += [arg for parent in parents for arg in ("--perms", "0755", "--dir", parent)]
        args += [arg for option, path in shown for arg in (option, path, path)]
        # The unprivileged bwrap inside mounts a fresh /proc, which the kernel allows only where
        # one is fully visible.
        args += ["--bind", "/proc", "/proc", "--dev-bind", "/dev", "/dev"]
        return [*args, *(arg for capability in _SETPRIV_CAPABILITIES for arg in ("--cap-add", capability)), "--"]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def holder_command(info_fd: int, owner: tuple[int, int]) -> list[str]:
    """A process that holds a fresh network namespace (only loopback up) for others to join, and
    writes ``{"child-pid": ...}`` to ``info_fd``: no ``--dev``, so that the user namespace the
    holder runs in is the one owning its network namespace (with ``--dev`` bwrap nests a second).
    It runs as ``owner``, the run's replicas' uid: only they may enter it."""
    args = [*_drop_privileges(owner), "bwrap", "--unshare-user", "--unshare-net", "--unshare-pid", "--unshare-ipc"]
    args += ["--die-with-parent", *_system_view(), "--info-fd", str(info_fd), "--", "sleep", "infinity"]
    return args


def _under(path: str, directories) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in directories)

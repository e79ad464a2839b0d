"""What a sandboxed process may ask of the kernel (``hetflow.sandbox`` with ``hetflow.seccomp``):
the container tools' default seccomp profile (Debian's /usr/share/containers/seccomp.json) refuses
the calls exploits reach for, no user namespace can be nested, no keyring but a fresh one reached,
no supplementary group held, while what training and serving use still works. Real bubblewrap
sandboxes; the hostile process calls the kernel directly (ctypes)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import run_sandboxed

from hetflow import sandbox, seccomp

# Each call made raw, as an exploit would, with one line per call: "ok" or the errno it got.
_PROBE = textwrap.dedent(
    """
    import ctypes, os, socket, threading
    libc = ctypes.CDLL(None, use_errno=True)
    number = dict(NUMBERS)
    def call(label, *args):
        ctypes.set_errno(0)
        result = libc.syscall(number[label], *args)
        print(label, "ok" if result >= 0 else ctypes.get_errno())
    call("unshare", 0x10000000)  # CLONE_NEWUSER: a user namespace, root inside it
    call("clone", 0x10000000 | 17, 0, 0, 0, 0)  # CLONE_NEWUSER | SIGCHLD
    call("keyctl", 0, -3, 0)  # KEYCTL_GET_KEYRING_ID of the session keyring
    call("add_key", b"user", b"planted", b"x", 1, -3)
    call("mount", b"none", b"/tmp", b"tmpfs", 0, 0)
    call("bpf", 0, 0, 0)
    call("userfaultfd", 0)
    call("io_uring_setup", 1, 0)
    call("setns", 0, 0)
    # What training and serving do: threads, anonymous memory files, sockets.
    threading.Thread(target=lambda: None).start()
    call("memfd_create", b"weights", 0)
    socket.socket().close()
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    print("groups", status["Groups"].strip() or "none")
    print("seccomp", status["Seccomp"].strip())
    """
)


def _numbers() -> dict[str, int]:
    lib = ctypes.CDLL("libseccomp.so.2")
    names = ("unshare", "clone", "keyctl", "add_key", "mount", "bpf", "userfaultfd", "io_uring_setup", "setns")
    return {name: lib.seccomp_syscall_resolve_name(name.encode()) for name in (*names, "memfd_create")}


def test_a_sandboxed_process_gets_no_namespace_keyring_mount_or_bpf_and_still_runs_threads_and_sockets(tmp_path):
    box = sandbox.Sandbox(owner=sandbox.run_owner(tmp_path))
    probe = _PROBE.replace("NUMBERS", repr(sorted(_numbers().items())))
    done = run_sandboxed(box, [sys.executable, "-c", probe])
    assert done.returncode == 0, done.stderr
    seen = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    # Refused by the profile (add_key, io_uring_setup: ENOSYS), by no capability (mount, bpf,
    # userfaultfd: EPERM; setns) or by --disable-userns (a user namespace: ENOSPC). keyctl is allowed:
    # the replica's session keyring is a fresh one (the keyring test below).
    refused = ("unshare", "clone", "add_key", "mount", "bpf", "userfaultfd", "io_uring_setup", "setns")
    assert {call: seen[call] for call in refused if seen[call] == "ok"} == {}, seen
    assert seen["add_key"] == seen["io_uring_setup"] == "38", seen  # ENOSYS: what the profile answers
    assert seen["memfd_create"] == "ok"
    assert seen["seccomp"] == "2"  # a filter loaded
    assert seen["groups"] == "none"


def test_no_user_namespace_can_be_nested_even_where_the_profile_would_allow_the_call(monkeypatch):
    """bubblewrap's --disable-userns holds alone: with a filter that allows everything, unshare of a
    user namespace still fails inside the sandbox."""
    monkeypatch.setattr(seccomp, "program", lambda: _allow_everything())
    box = sandbox.Sandbox()
    probe = "import ctypes; c = ctypes.CDLL(None, use_errno=True); print(c.unshare(0x10000000), ctypes.get_errno())"
    done = run_sandboxed(box, [sys.executable, "-c", probe])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["-1", "28"]  # ENOSPC: its namespace may hold no more user namespaces


def _allow_everything() -> bytes:
    """A compiled filter that allows every call (libseccomp's own compiler, no profile)."""
    lib = seccomp._libseccomp()
    context = lib.seccomp_init(0x7FFF0000)
    out = os.memfd_create("allow")
    try:
        assert lib.seccomp_export_bpf(context, out) == 0
        return os.pread(out, os.fstat(out).st_size, 0)
    finally:
        os.close(out)
        lib.seccomp_release(context)


@pytest.mark.parametrize(
    ("rule", "kept"),
    [
        ({"names": ["ptrace"], "includes": {"minKernel": "4.8"}}, True),
        ({"names": ["bpf"], "includes": {"caps": ["CAP_SYS_ADMIN"]}}, False),
        ({"names": ["clone"], "excludes": {"caps": ["CAP_SYS_ADMIN"], "arches": ["s390"]}}, True),
        ({"names": ["arch_prctl"], "includes": {"arches": ["amd64", "x32"]}}, os.uname().machine == "x86_64"),
        ({"names": ["future"], "includes": {"minKernel": "99.0"}}, False),
    ],
)
def test_the_profile_is_read_as_moby_reads_it_for_a_process_without_capabilities(rule, kept):
    assert seccomp._applies(rule, {"x86_64": "amd64", "aarch64": "arm64"}[os.uname().machine]) is kept


_SESSION_KEYRING = (
    "import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); print(libc.syscall(int(sys.argv[1]), 0, -3, 0))"
)


def test_a_local_replica_starts_with_a_session_keyring_of_its_own_not_its_keepers():
    """Whatever the keeper's session keyring holds (the task's: under a login, the user's keys), the
    replica's is a new one: the keeper's preexec joins a fresh anonymous keyring before bwrap runs."""
    from hetflow.cluster.backends.local.keeper import _replica_preexec

    keyctl = seccomp.syscall_number("keyctl")
    command = [sys.executable, "-c", _SESSION_KEYRING, str(keyctl)]
    keepers = subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()
    replicas = subprocess.run(command, preexec_fn=_replica_preexec(None), capture_output=True, text=True, check=True)
    assert int(keepers[0]) > 0 and int(replicas.stdout) > 0
    assert int(replicas.stdout) != int(keepers[0])

"""The system calls a sandboxed process may make: the default seccomp profile of the container
tools, as Debian ships it (``/usr/share/containers/seccomp.json``, package
golang-github-containers-common: containers/common's profile, Docker's default kept for podman and
its kin, in Docker's format), compiled with libseccomp into the BPF program that bubblewrap's
``--seccomp`` loads.

A well-kept profile rather than a list of our own: it refuses what containers never need and what
kernel exploits reach for (``unshare``, ``setns``, ``mount``, ``keyctl``, ``bpf``, ``userfaultfd``,
``io_uring``, clone with namespace flags, ...), and allows what TensorFlow and MLflow's server use;
a system call it does not name gets ENOSYS, as newer ones should. Its rules are read as moby reads
them (``setupSeccomp``) for this machine's architecture and a process holding no capability, the
state of every sandboxed process; conditions on one argument become one rule each, as runc adds them.
``make sandbox`` installs it; Debian's updates keep it current.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import json
import os
import platform
from pathlib import Path

PROFILE = Path("/usr/share/containers/seccomp.json")
PROFILE_PACKAGE = "golang-github-containers-common"

# This machine as the profile names it (Go's architecture names) and as libseccomp does.
_ARCHITECTURES = {"x86_64": ("amd64", "SCMP_ARCH_X86_64"), "aarch64": ("arm64", "SCMP_ARCH_AARCH64")}
_ACT_ALLOW = 0x7FFF0000
_ACT_ERRNO = 0x00050000
_OPERATORS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5}
_OPERATORS |= {"SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}


class SeccompUnavailable(RuntimeError):
    """The profile cannot be compiled here (no libseccomp, an architecture it does not cover)."""


class _Condition(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


def _libseccomp():
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        raise SeccompUnavailable("no libseccomp (Debian's libseccomp2) to compile the seccomp profile") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_Condition),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def _kernel_at_least(version: str) -> bool:
    def numbers(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split("-")[0].split(".")[:2])

    return numbers(os.uname().release) >= numbers(version)


def _applies(rule: dict, arch: str) -> bool:
    """Whether moby keeps ``rule`` for ``arch`` and a process without capabilities."""
    excludes, includes = rule.get("excludes") or {}, rule.get("includes") or {}
    if arch in excludes.get("arches", []) or ("minKernel" in excludes and _kernel_at_least(excludes["minKernel"])):
        return False
    if includes.get("arches") and arch not in includes["arches"]:
        return False
    if includes.get("caps"):
        return False  # a rule for holders of a capability: a sandboxed process holds none
    return "minKernel" not in includes or _kernel_at_least(includes["minKernel"])


def _condition_sets(arguments: list[dict]) -> list[list[dict]]:
    """One rule with every condition, or, where one argument has several, one rule per condition."""
    indexes = [argument["index"] for argument in arguments]
    return [arguments] if len(set(indexes)) == len(indexes) else [[argument] for argument in arguments]


def _add(lib, context, rule: dict, action: int) -> None:
    for name in rule["names"]:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            continue  # a system call this architecture does not have
        for conditions in _condition_sets(rule.get("args") or []):
            array = (_Condition * max(1, len(conditions)))(
                *(_Condition(c["index"], _OPERATORS[c["op"]], c["value"], c.get("valueTwo", 0)) for c in conditions)
            )
            failed = lib.seccomp_rule_add_array(context, action, number, len(conditions), array)
            # -EEXIST: a rule the profile states twice (its socket rules do) is in already.
            if failed and failed != -errno.EEXIST:
                raise SeccompUnavailable(f"libseccomp refused the profile's rule for {name}: {os.strerror(-failed)}")


def _action(rule: dict, profile: dict) -> int:
    if rule["action"] == "SCMP_ACT_ALLOW":
        return _ACT_ALLOW
    if rule["action"] == "SCMP_ACT_ERRNO":
        return _ACT_ERRNO | rule.get("errnoRet", profile.get("defaultErrnoRet", 1))
    raise SeccompUnavailable(f"the seccomp profile's action {rule['action']} is not one hetflow compiles")


@functools.cache
def program() -> bytes:
    """The profile compiled for this machine (once per process): what ``--seccomp`` reads."""
    machine = platform.machine()
    if machine not in _ARCHITECTURES:
        raise SeccompUnavailable(f"the seccomp profile is not compiled for this machine ({machine})")
    arch, native = _ARCHITECTURES[machine]
    try:
        profile = json.loads(PROFILE.read_text())
    except FileNotFoundError:
        raise SeccompUnavailable(f"no seccomp profile at {PROFILE} (Debian's {PROFILE_PACKAGE})") from None
    lib = _libseccomp()
    context = lib.seccomp_init(_action({"action": profile["defaultAction"]}, profile))
    if not context:
        raise SeccompUnavailable("libseccomp could not start a filter")
    try:
        [entry] = [entry for entry in profile["archMap"] if entry["architecture"] == native]
        for name in entry["subArchitectures"]:
            token = lib.seccomp_arch_resolve_name(name.removeprefix("SCMP_ARCH_").lower().encode())
            if token and lib.seccomp_arch_add(context, token) not in (0, -17):  # -EEXIST: already there
                raise SeccompUnavailable(f"libseccomp could not add the architecture {name}")
        for rule in profile["syscalls"]:
            if _applies(rule, arch):
                _add(lib, context, rule, _action(rule, profile))
        out = os.memfd_create("hetflow-seccomp")
        try:
            if lib.seccomp_export_bpf(context, out):
                raise SeccompUnavailable("libseccomp could not export the seccomp program")
            return os.pread(out, os.fstat(out).st_size, 0)
        finally:
            os.close(out)
    finally:
        lib.seccomp_release(context)


def syscall_number(name: str) -> int:
    """This machine's number of the system call ``name``."""
    number = _libseccomp().seccomp_syscall_resolve_name(name.encode())
    if number < 0:
        raise SeccompUnavailable(f"no system call {name} on this machine")
    return number


def program_descriptor() -> int:
    """A fresh descriptor holding the program, at its start, for one bwrap to read (``--seccomp``)."""
    fd = os.memfd_create("hetflow-seccomp", 0)
    os.write(fd, program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd

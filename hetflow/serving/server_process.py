"""A model server's process, whichever server it is (MLflow's, for the served check in
``hetflow.serving.server``; hetflow's own, for the endpoint's replicas in ``hetflow.serving.replicas``):
the version's files copied from the registry, the server launched sandboxed (or, where the operator
accepted it, unisolated) in a process group of its own, the wait for its ``/ping``, the group's end.

``stop_group`` ends within ``STOP_GRACE_SECONDS`` plus a SIGKILL's wait, and never raises.
"""

from __future__ import annotations

import ctypes
import http.client
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from hetflow import sandbox
from hetflow.cluster.processes import group_members

log = logging.getLogger("hetflow.serving")


# Far more than a start alone takes (a run's served check records its start_seconds): a loaded
# machine starts it several times slower.
START_DEADLINE_SECONDS = 180.0
STOP_GRACE_SECONDS = 10.0
REQUEST_TIMEOUT_SECONDS = 60.0


class ServingError(RuntimeError):
    pass


def server_environment() -> dict[str, str]:
    """What a user's shell gives a model server, and nothing of the pipeline's (no
    TF_USE_LEGACY_KERAS, PYTHONPATH, Airflow or hetflow variables, no registry credentials: it
    serves a downloaded copy): PATH with the venv's bin/, HOME and locale."""
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"])}
    env.update((key, os.environ[key]) for key in ("HOME", "LANG") if key in os.environ)
    return env


def name_and_version(model_uri: str) -> tuple[str, str]:
    """``models:/NAME/VERSION``'s name and version."""
    name, _, version = model_uri.removeprefix("models:/").rpartition("/")
    if not name or not version.isdigit():
        raise ServingError(f"{model_uri!r} is not models:/NAME/VERSION")
    return name, version


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over the Unix socket that reaches a sandboxed server (see the module's doc)."""

    def __init__(self, path: Path, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def _die_with_starter() -> None:
    """Runs in an unisolated server before exec: SIGKILL when the process that started it dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def isolation(what: str, tracking_uri: str) -> dict[str, Any]:
    """How ``what`` (a model server) runs: sandboxed, hiding hetflow's private folders; or, where no
    sandbox can be had and the operator accepted it, unisolated (else ``sandbox.SandboxUnavailable``)."""
    if sandbox.required(what):
        return {"confined": True, "sandbox": "bubblewrap", "hidden": sandbox.private_directories(tracking_uri)}
    return {"confined": False, "reason": sandbox.unavailable()}


def copy_version(model_uri: str, tracking_uri: str, destination: Path) -> Path:
    """The files of ``models:/NAME/VERSION`` copied into the folder ``destination`` (made by the
    caller, its owner's only: a registered model is not every local user's to read); the model's
    folder in it is returned. Nothing is loaded.

    The version's files are found through a client of ``tracking_uri`` as registry: MLflow's
    ``download_artifacts`` resolves a ``models:/`` URI in the process-wide registry whatever
    registry it is given (``ModelsArtifactRepository``), so it is given the files' own location."""
    import mlflow
    from hetflow.registry import store

    try:
        name, version = name_and_version(model_uri)
        location = store.client(tracking_uri).get_model_version_download_uri(name, version)
        copy = mlflow.artifacts.download_artifacts(location, dst_path=str(destination), tracking_uri=tracking_uri)
    except Exception as error:  # MLflow raises its own kinds, and OSError
        raise ServingError(f"could not copy {model_uri} from the registry: {error}") from error
    return Path(copy)


def launch(
    command: list[str],
    isolation: dict[str, Any],
    log_path: Path,
    env: dict[str, str],
    read_write: list[str],
    read_only: list[str],
) -> subprocess.Popen:
    """Start ``command`` (a model server) in its own process group, its output to ``log_path``:
    sandboxed, if ``isolation`` is confined, seeing ``read_write`` and ``read_only`` (and the
    system, the code and the interpreter); either way dying with this process, with
    ``server_environment()`` and ``env``. The log's folder is its working directory outside a
    sandbox (uvicorn puts that on ``sys.path``, so it must hold no Python modules).

    The parent-death signal is sent when the *thread* that started it ends: start servers from a
    thread that lives as long as they should."""
    confined = isolation["confined"]
    box = sandbox.Sandbox(read_write=read_write, read_only=read_only, hidden=isolation["hidden"]) if confined else None
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(log_path, "wb") as output:
            return subprocess.Popen(
                box.command(command) if box else command,
                # A sandboxed server's HOME is its own /tmp: the user's is not there.
                env={**server_environment(), **env, **({"HOME": "/tmp"} if confined else {})},
                cwd=log_path.parent,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop_group ends bwrap and all inside
                pass_fds=box.fds if box else (),
                preexec_fn=None if confined else _die_with_starter,  # bwrap's --die-with-parent does it
            )
    finally:
        if box is not None:
            box.close()


def wait_until_healthy(
    process: subprocess.Popen,
    connect: Callable[[float], http.client.HTTPConnection],
    deadline: float,
    log_tail: Callable[[], str],
) -> None:
    """Return once ``GET /ping`` on ``connect(timeout)`` answers 200; ServingError if ``process``
    exits first or ``deadline`` (a ``time.monotonic()`` value) passes, with its log's end."""
    while True:
        code = process.poll()
        if code is not None:
            raise ServingError(f"server exited with code {code} before it was healthy; its log ends: {log_tail()}")
        connection = connect(1.0)
        try:
            connection.request("GET", "/ping")
            if connection.getresponse().status == 200:
                return
        except (OSError, http.client.HTTPException):
            pass  # not listening yet, or the model still loading
        finally:
            connection.close()
        if time.monotonic() >= deadline:
            raise ServingError(f"server not healthy by its deadline; its log ends: {log_tail()}")
        time.sleep(0.1)


def stop_group(process: subprocess.Popen, what: str) -> None:
    """End ``process``'s process group (``launch`` made it the leader of one): SIGTERM, then
    SIGKILL after ``STOP_GRACE_SECONDS``; reap the leader. Never raises: it runs in finally blocks,
    also after other errors."""
    try:
        pgid = process.pid  # start_new_session: the group id is the leader's pid
        for sig, wait in ((signal.SIGTERM, STOP_GRACE_SECONDS), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while group_members(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not group_members(pgid):
                break
        process.wait(timeout=5)  # reap the leader
        if group_members(pgid):
            log.warning("%s: group %s still has processes %s after SIGKILL", what, pgid, group_members(pgid))
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("stopping %s", what)

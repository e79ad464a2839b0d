"""One registered model version served by ``replicas`` sandboxed model-server processes
(``hetflow/serving/model_server/``), each on a Unix socket of its own, for the endpoint's load
balancer to reach (``unix@PATH``).

A version's life here::

    stage()  copy the version's files from the registry into RUN_DIR/model, check the copy, record
       │     its manifest (RUN_DIR/manifest.json); atomic: a copy that fails its check never lands
       ▼
    start(deadline)  re-check the copy against its manifest, start every replica, wait for each /ping
       │
       ├─► alive(), dead_replicas(), restart(index), input_example(), request(...), predict(images)
       ▼
    stop()  ask each server to stop (its requests in flight finish), then end every replica's process
            group; never raises (the files stay: the caller's folder)

What the copy's check refuses, and why (a registered version's files are someone else's: its run
wrote them, and the registry's folder may be shared):

- anything but regular files and folders: a symlink (or a socket, a device) could point the loader
  at a file outside the version (``/etc/passwd``, another version's weights);
- a file with more than one hard link: its bytes are shared with a file elsewhere, which may change;
- a listing that differs from the registry's, by name or size: a partial or altered copy;
- no ``MLmodel`` at the top: nothing says how to load it;
- at every start and restart, a file whose sha256 or size differs from the manifest recorded at
  staging: the copy changed between its check and its load.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from hetflow import sandbox
from hetflow.cluster.processes import group_members, is_running
from hetflow.serving.model_server import limits as server_limits
from hetflow.serving.server_process import (
    REQUEST_TIMEOUT_SECONDS,
    START_DEADLINE_SECONDS,
    ServingError,
    UnixHTTPConnection,
    copy_version,
    isolation,
    launch,
    name_and_version,
    stop_group,
    wait_until_healthy,
)

log = logging.getLogger("hetflow.serving")

MANIFEST = "manifest.json"
_SOCKET_PATH_MAX = 107  # sun_path's 108 bytes, less its terminating NUL
_LOG_TAIL_CHARS = 1500
_HASH_CHUNK = 1 << 20
# the model server: a folder run as `python -I FOLDER` (its __main__.py), FOLDER then on its sys.path
MODEL_SERVER = Path(__file__).with_name("model_server")


class CopyRefused(ServingError):
    """The copy of a version's files failed its check: nothing loads it."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file under ``folder`` by its relative path: ``{"bytes", "sha256"}``; CopyRefused for
    a symlink, a special file or a file linked elsewhere (see the module's doc)."""
    files = {}
    for root, directories, names in os.walk(folder):
        for name in [*directories, *names]:
            path = Path(root, name)
            relative = path.relative_to(folder).as_posix()
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                raise CopyRefused(f"the copy holds a symlink, {relative} -> {os.readlink(path)}: refused")
            if stat.S_ISDIR(info.st_mode):
                continue
            if not stat.S_ISREG(info.st_mode):
                raise CopyRefused(f"the copy holds {relative}, neither a file nor a folder: refused")
            if info.st_nlink > 1:
                raise CopyRefused(
                    f"the copy's {relative} has {info.st_nlink} hard links (its bytes are shared): refused"
                )
            files[relative] = {"bytes": info.st_size, "sha256": _sha256(path)}
    return files


def registry_listing(location: str, tracking_uri: str) -> dict[str, int]:
    """The registry's own listing of a version's files: relative path -> bytes."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repository = get_artifact_repository(location, tracking_uri=tracking_uri)
    listing, folders = {}, [None]
    while folders:
        for entry in repository.list_artifacts(folders.pop()):
            if entry.is_dir:
                folders.append(entry.path)
            else:
                listing[entry.path] = entry.file_size
    return listing


def check_copy(folder: Path, listing: dict[str, int]) -> dict[str, dict[str, Any]]:
    """The manifest of the copy in ``folder``, if it is what the registry lists; else CopyRefused."""
    files = file_manifest(folder)
    copied = {path: entry["bytes"] for path, entry in files.items()}
    if copied != listing:
        differ = sorted(set(copied.items()) ^ set(listing.items()))
        raise CopyRefused(f"the copy differs from the registry's listing (path, bytes) at {differ[:3]}: refused")
    if "MLmodel" not in files:
        raise CopyRefused("the copy has no MLmodel file at its top: refused")
    return files


def verify_copy(folder: Path, manifest: dict[str, dict[str, Any]]) -> None:
    """CopyRefused unless the files under ``folder`` are still those of ``manifest``."""
    files = file_manifest(folder)
    changed = sorted(path for path in set(files) | set(manifest) if files.get(path) != manifest.get(path))
    if changed:
        raise CopyRefused(f"the copy changed since it was checked ({', '.join(changed[:3])}): refused")


def _read_only(folder: Path) -> None:
    """The checked copy's files read-only (the sandbox sees it all read-only; its folders stay its
    owner's to remove)."""
    for root, _, names in os.walk(folder):
        for name in names:
            os.chmod(Path(root, name), 0o444)


@dataclass
class Replica:
    index: int
    socket: Path
    log_path: Path
    process: Any = None  # subprocess.Popen once started


class VersionServers:
    """The model servers of ``models:/NAME/VERSION``, serving a checked copy of its files.

    :param run_dir: this version's folder (the copy, its manifest, the sockets, the logs); kept by
        ``stop()``. Its path must be short enough for the sockets' (107 bytes).
    :param replicas: model-server processes, each on ``RUN_DIR/s/<i>.sock``.
    :param max_instances: instances per request a server accepts (more: 400).
    :param threads: computations at once in one server (TensorFlow's threads, LiteRT interpreters).
    :param max_body_bytes: a request body's limit (more: 413).

    Started from a thread that lives as long as the servers: they die with it (``server.launch``).
    """

    def __init__(
        self,
        model_uri: str,
        tracking_uri: str,
        run_dir: Path,
        replicas: int = 1,
        max_instances: int = server_limits.DEFAULT_MAX_INSTANCES,
        threads: int = 1,
        max_body_bytes: int = server_limits.DEFAULT_MAX_BODY_BYTES,
    ):
        if replicas < 1 or max_instances < 1 or threads < 1 or max_body_bytes < 1:
            raise ValueError(
                f"replicas={replicas}, max_instances={max_instances}, threads={threads}, "
                f"max_body_bytes={max_body_bytes}: each must be at least 1"
            )
        self.model_uri = model_uri
        self.tracking_uri = tracking_uri
        self.name, self.version = name_and_version(model_uri)
        self.run_dir = Path(run_dir).absolute()
        self.model_dir = self.run_dir / "model"
        self.options = {"max-instances": max_instances, "threads": threads, "max-body-bytes": max_body_bytes}
        self.replicas = [
            Replica(i, self.run_dir / "s" / f"{i}.sock", self.run_dir / "logs" / f"replica-{i}.log")
            for i in range(replicas)
        ]
        longest = max(len(os.fsencode(replica.socket)) for replica in self.replicas)
        if longest > _SOCKET_PATH_MAX:
            raise ValueError(
                f"run_dir {self.run_dir} is too long for its sockets ({longest} > {_SOCKET_PATH_MAX} bytes)"
            )
        self.isolation = isolation(f"the model servers of {model_uri}", tracking_uri)
        self.manifest: dict[str, dict[str, Any]] | None = None

    @property
    def sockets(self) -> list[Path]:
        return [replica.socket for replica in self.replicas]

    @property
    def pgids(self) -> list[int | None]:
        """Each replica's process group (its leader's pid), None where it was never started."""
        return [replica.process.pid if replica.process else None for replica in self.replicas]

    def stage(self) -> dict[str, dict[str, Any]]:
        """Copy and check the version's files (once; a staged run_dir is re-used); its manifest."""
        if self.manifest is not None:
            return self.manifest
        manifest_path = self.run_dir / MANIFEST
        if manifest_path.exists() and self.model_dir.is_dir():
            self.manifest = json.loads(manifest_path.read_text())["files"]
            return self.manifest
        self.run_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.run_dir))  # 0700: the owner's only
        try:
            copied = copy_version(self.model_uri, self.tracking_uri, staging)
            from hetflow.registry import store

            location = store.client(self.tracking_uri).get_model_version_download_uri(self.name, self.version)
            files = check_copy(copied, registry_listing(location, self.tracking_uri))
            _read_only(copied)
            record = {"model_uri": self.model_uri, "source": location, "files": files}
            manifest_path.with_suffix(".tmp").write_text(json.dumps(record, indent=1))
            manifest_path.with_suffix(".tmp").rename(manifest_path)
            shutil.rmtree(self.model_dir, ignore_errors=True)  # an earlier try's, whose manifest never landed
            os.rename(copied, self.model_dir)  # atomic: the model folder is whole and checked, or absent
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.manifest = files
        return files

    def start(self, deadline: float) -> None:
        """Stage (if not yet), re-check the copy, start every replica, return once each answers
        ``/ping``; ``deadline`` is a ``time.monotonic()`` value. On any failure, what was started
        is stopped and ServingError (CopyRefused for the copy) says why."""
        try:
            verify_copy(self.model_dir, self.stage())
            (self.run_dir / "s").mkdir(exist_ok=True)
            sandbox.hand_over(self.run_dir / "s")
            for replica in self.replicas:
                self._launch(replica)
            for replica in self.replicas:
                self._wait(replica, deadline)
        except BaseException:
            self.stop()
            raise

    def _launch(self, replica: Replica) -> None:
        replica.socket.unlink(missing_ok=True)
        options = [f"--{option}={value}" for option, value in self.options.items()]
        command = [sys.executable, "-I", str(MODEL_SERVER), "--model-dir", str(self.model_dir)]
        command += ["--name", self.name, "--version", self.version, "--socket", str(replica.socket), *options]
        replica.process = launch(
            command,
            self.isolation,
            replica.log_path,
            {"TF_CPP_MIN_LOG_LEVEL": "2"},  # TensorFlow's start-up notices would bury the server's own lines
            read_write=[str(replica.socket.parent)],
            read_only=[str(self.model_dir)],
        )

    def _wait(self, replica: Replica, deadline: float) -> None:
        try:
            wait_until_healthy(
                replica.process,
                lambda timeout: UnixHTTPConnection(replica.socket, timeout),
                deadline,
                lambda: self.log_tail(replica.index),
            )
        except ServingError as error:
            raise ServingError(f"{self.model_uri} replica {replica.index}: {error}") from error

    def log_tail(self, index: int) -> str:
        try:
            return self.replicas[index].log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:].strip()
        except OSError:
            return ""

    def alive(self) -> list[bool]:
        """Whether each replica's process is running (a dead one's sandbox ends with it)."""
        return [replica.process is not None and replica.process.poll() is None for replica in self.replicas]

    def dead_replicas(self) -> list[int]:
        """The replicas started whose process has exited."""
        return [r.index for r, alive in zip(self.replicas, self.alive()) if r.process is not None and not alive]

    def restart(self, index: int, deadline: float | None = None) -> None:
        """Start replica ``index`` anew (what is left of it ended first) from the re-checked copy,
        and wait for its ``/ping`` until ``deadline`` (a ``time.monotonic()`` value; default
        ``START_DEADLINE_SECONDS`` from now); ServingError if it does not come up (it is left stopped)."""
        deadline = time.monotonic() + START_DEADLINE_SECONDS if deadline is None else deadline
        replica = self.replicas[index]
        if replica.process is not None:
            stop_group(replica.process, f"{self.model_uri} replica {index}")
        try:
            verify_copy(self.model_dir, self.stage())
            self._launch(replica)
            self._wait(replica, deadline)
        except BaseException:
            if replica.process is not None:
                stop_group(replica.process, f"{self.model_uri} replica {index}")
            raise

    def input_example(self) -> np.ndarray:
        """The input example MLflow recorded with the version (``saved_input_example_info``), from
        the staged copy, in its signature's type; ServingError if it recorded no array."""
        mlmodel = yaml.safe_load((self.model_dir / "MLmodel").read_text())
        info = mlmodel.get("saved_input_example_info") or {}
        if info.get("type") != "ndarray":
            raise ServingError(f"{self.model_uri} has no input example of arrays (MLmodel: {info or 'none'})")
        example = json.loads((self.model_dir / info["artifact_path"]).read_text())
        inputs = json.loads((mlmodel.get("signature") or {}).get("inputs") or "[]")
        dtype = inputs[0].get("tensor-spec", {}).get("dtype") if len(inputs) == 1 else None
        return np.asarray(example, dtype=dtype)

    def request(
        self, method: str, path: str, body: Any = None, replica: int = 0, timeout: float = REQUEST_TIMEOUT_SECONDS
    ) -> tuple[int, dict[str, str], bytes]:
        """One HTTP request to one replica (``body``: JSON-able, or bytes): status, headers, body."""
        connection = UnixHTTPConnection(self.replicas[replica].socket, timeout)
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        try:
            connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            connection.close()

    def predict(self, images: np.ndarray, replica: int = 0) -> np.ndarray:
        """The version's predictions on ``images``, as a TF Serving client asks for them (batches of
        at most ``max_instances``), from one replica; ServingError on any other answer than 200."""
        path = f"/v1/models/{self.name}/versions/{self.version}:predict"
        batch = self.options["max-instances"]
        answers = []
        for start in range(0, len(images), batch):
            try:
                status, _, answer = self.request(
                    "POST", path, {"instances": images[start : start + batch].tolist()}, replica
                )
                if status != 200:
                    raise ServingError(f"{path} answered {status}: {answer[:500].decode(errors='replace')}")
                answers.append(np.asarray(json.loads(answer)["predictions"], dtype=np.float32))
            except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
                raise ServingError(f"{path} on replica {replica} failed: {error!r}") from error
        return np.concatenate(answers)

    def server_pid(self, index: int) -> int | None:
        """The model server's own process in replica ``index``'s group (setpriv and bwrap, which
        lead it, name it in their command lines too), None if it is not running."""
        replica = self.replicas[index]
        if replica.process is None:
            return None
        command = [os.fsencode(sys.executable), b"-I", os.fsencode(MODEL_SERVER)]
        for pid in group_members(replica.process.pid):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:3] == command:
                    return pid
            except OSError:
                continue  # it ended meanwhile
        return None

    def stop(self) -> None:
        """End every replica, and remove its socket; never raises. Each server is asked first
        (SIGTERM to it alone: its requests in flight finish, up to the model server's DRAIN_SECONDS),
        then its process group is ended (a signal to the sandbox's bwrap ends all in it at once)."""
        try:
            asked = [pid for pid in map(self.server_pid, range(len(self.replicas))) if pid is not None]
            for pid in asked:
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + server_limits.DRAIN_SECONDS + 1
            while any(is_running(pid) for pid in asked) and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - stop() must never raise; the groups are ended below whatever happened
            log.exception("asking the model servers of %s to stop", self.model_uri)
        for replica in self.replicas:
            if replica.process is not None:
                stop_group(replica.process, f"{self.model_uri} replica {replica.index}")
            try:
                replica.socket.unlink(missing_ok=True)
            except OSError:
                log.exception("removing %s", replica.socket)

    def __enter__(self) -> VersionServers:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

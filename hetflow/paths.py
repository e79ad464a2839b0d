"""Where a run's files live (``$HETFLOW_HOME/runs/<readable run id>-<hash>/``, the shared data dir),
and how a record is written there."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[1]


def hetflow_home() -> Path:
    return Path(os.environ.get("HETFLOW_HOME", REPO_ROOT / ".hetflow")).resolve()


def data_dir(home: Path | None = None) -> Path:
    """TFDS data dir, shared by all runs so a dataset is prepared once."""
    return (home or hetflow_home()) / "data"


def run_dir_name(run_id: str) -> str:
    """The run's directory name: the id made path-safe, to be readable, plus a hash of the real id,
    so that ids which read alike (``x:1``, ``x+1``, ``x_1``) never share a directory."""
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id={run_id!r} is invalid: expected a non-empty string")
    # Airflow run ids carry ':' and '+' (manual__2026-01-01T00:00:00+00:00); a file name has 255 bytes.
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:100]
    return f"{readable}-{hashlib.sha256(run_id.encode()).hexdigest()[:12]}"


class RunDirectoryTaken(RuntimeError):
    """The run directory was created by another run id."""


def write_record(path: Path, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` atomically: a reader (another run, a retried task) sees the
    old record or the new one, never half of one, even when the writer is killed mid-write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique per writer, beside the target (os.replace is atomic only within one file system).
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    # 0o666 less the umask, as a plain open() would give: replicas in containers read these files.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(value, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())  # the bytes are on disk before the name points at them
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class NotRegularFile(ValueError):
    """A file a replica (or anyone else) could have written is not what the pipeline reads."""


# What the pipeline reads of a JSON record a replica writes (training.json, plan.json, probes).
REPLICA_RECORD_BYTES = 16 << 20


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``max_bytes``, opened without
    following a link (a replica may plant one at any name it can write); else NotRegularFile,
    one line naming the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:  # the name is a symbolic link
            raise NotRegularFile(f"{path} is a symbolic link: refused (the pipeline reads regular files only)")
        raise
    with os.fdopen(fd, "rb") as handle:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise NotRegularFile(f"{path} is not a regular file: refused")
        if status.st_size > max_bytes:
            raise NotRegularFile(f"{path} holds {status.st_size} bytes, more than the {max_bytes} allowed: refused")
        return handle.read(max_bytes + 1)[:max_bytes]


def read_replica_record(path: Path, kind: type = dict) -> Any:
    """A JSON object (or a ``kind``: list) a replica wrote, read as data: a regular file, bounded."""
    content = read_regular(path, REPLICA_RECORD_BYTES)  # its NotRegularFile names the file once
    try:
        value = json.loads(content)
    except ValueError as error:
        raise NotRegularFile(f"{path} is not a JSON record: {error}") from None
    if not isinstance(value, kind):
        expected = "an object" if kind is dict else f"a JSON {kind.__name__}"
        raise NotRegularFile(f"{path} holds a JSON {type(value).__name__}, not {expected}: refused")
    return value


class Entry(NamedTuple):
    """One name met by ``entries_under``: act on it as ``name`` relative to ``directory_fd``."""

    directory_fd: int
    path: Path  # for messages only: acting by path would follow a link swapped in since
    name: str
    mode: int


_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def entries_under(root: Path, names: Collection[str] | None = None) -> Iterator[Entry]:
    """Everything under ``root`` (of its own entries, only ``names`` where given, and what they hold),
    parents before what they hold, each as an ``Entry`` whose
    ``directory_fd`` stays open while the caller acts on it. No link is followed: every directory is
    opened by name relative to its parent's descriptor with ``O_NOFOLLOW``, so a directory that a live
    replica swaps for a link to elsewhere between the listing and the use is never entered, and
    nothing outside ``root`` is ever reached."""
    try:
        top = os.open(root, _DIRECTORY_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as error:
        if error.errno == errno.ELOOP:
            return  # root is a link itself: its caller removes or refuses it by name
        raise
    try:
        yield from _entries(top, Path(root), names)
    finally:
        os.close(top)


def _entries(directory_fd: int, directory: Path, names: Collection[str] | None = None) -> Iterator[Entry]:
    for name in os.listdir(directory_fd) if names is None else set(names) & set(os.listdir(directory_fd)):
        try:
            mode = os.stat(name, dir_fd=directory_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            continue
        yield Entry(directory_fd, directory / name, name, mode)
        if not stat.S_ISDIR(mode):
            continue
        try:
            child = os.open(name, _DIRECTORY_FLAGS, dir_fd=directory_fd)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                continue  # swapped for a link (or something else) since it was listed: not entered
            raise
        try:
            yield from _entries(child, directory / name)
        finally:
            os.close(child)


def planted(mode: int) -> bool:
    """Whether a file of ``mode`` is one the pipeline never makes in a run directory: a link, a
    fifo, a socket, a device node (anything but a regular file or a directory)."""
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def owner(self) -> Path:
        """The real run id, written when the directory is created."""
        return self.root / "run_id"

    def attempt(self, stage: str) -> Path:
        """Which attempt of ``stage`` wrote its record (hetflow.pipeline.attempts)."""
        return self.root / "attempts" / f"{stage}.json"

    @property
    def spec(self) -> Path:
        return self.root / "spec.json"

    @property
    def dataset(self) -> Path:
        return self.root / "dataset.json"

    @property
    def cluster(self) -> Path:
        return self.root / "cluster.json"

    @property
    def output(self) -> Path:
        """The one folder replicas write: every backend shows them the run directory read-only and this
        folder alone read-write, so that nothing they make lands where the pipeline's stages write.
        Provisioning makes it and hands it over; what is in it is read as untrusted data."""
        return self.root / "replica_output"

    @property
    def plan(self) -> Path:
        return self.output / "plan.json"

    @property
    def requested_spec(self) -> Path:
        """strategy=auto: the spec as requested (spec.json holds the one being trained). In ``replicas/``,
        which replicas see read-only as a folder: whether a run is auto is never a file they can make."""
        return self.replicas / "requested_spec.json"

    @property
    def tracking(self) -> Path:
        """The DAG run's MLflow run, as its first stage made it (``hetflow.registry.live``)."""
        return self.root / "tracking.json"

    @property
    def provisioned_by(self) -> Path:
        """The process that provisioned the replicas (``hetflow.pipeline.provisioned_by``)."""
        return self.root / "provisioned_by.json"

    @property
    def checkpoints(self) -> Path:
        return self.output / "checkpoints"

    @property
    def restarts(self) -> Path:
        """The supervisor's restarts, rewritten while replicas run: in ``replicas/`` (see there)."""
        return self.replicas / "restarts.json"

    @property
    def nodes(self) -> Path:
        """backend=swarm: the node each replica runs on, rewritten while they run: in ``replicas/``."""
        return self.replicas / "nodes.json"

    @property
    def replicas(self) -> Path:
        """What the pipeline records of the replicas while they run: how each local replica ended, the
        supervisor's lease (hetflow.cluster.backends.local.keeper), the restarts, the nodes, auto's
        request. Replicas see this folder read-only as a whole, made before any starts: a file the
        pipeline renames into it stays out of their reach, where a read-only bind of one file is lost
        when the file is replaced."""
        return self.root / "replicas"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def model(self) -> Path:
        """The trained weights only: a replica's file is never loaded as a model (code could run);
        each stage rebuilds the architecture from the spec (``hetflow.models.architectures.trained_model``)."""
        return self.output / "model.weights.h5"

    @property
    def training(self) -> Path:
        return self.output / "training.json"

    @property
    def progress(self) -> Path:
        """The chief's figures of each epoch, a JSON line each, appended while it trains."""
        return self.output / "progress.jsonl"

    @property
    def evaluation(self) -> Path:
        return self.root / "evaluation.json"

    @property
    def compressed(self) -> Path:
        return self.root / "compressed"

    @property
    def compression(self) -> Path:
        return self.root / "compression.json"

    @property
    def saved_model(self) -> Path:
        return self.root / "export" / "saved_model"

    @property
    def float_tflite(self) -> Path:
        return self.root / "export" / "float.tflite"

    @property
    def export(self) -> Path:
        return self.root / "export.json"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def registry(self) -> Path:
        return self.root / "registry.json"

    @property
    def serving(self) -> Path:
        """The served checks' server logs (register)."""
        return self.root / "serving"

    @property
    def tensorboard(self) -> Path:
        """The training curves as TensorBoard events, logged to MLflow beside the run (register)."""
        return self.root / "tensorboard"

    @property
    def tfjob(self) -> Path:
        """backend=kubernetes: the TFJob manifest a user can apply where the training operator runs."""
        return self.root / "tfjob.yaml"

    @property
    def study(self) -> Path:
        """A tuning study's run: what it searches (``hetflow.tuning.space``)."""
        return self.root / "study.json"

    @property
    def trials(self) -> Path:
        """A tuning study's run: each trial, how it ended and its figures."""
        return self.root / "trials.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"


def run_paths(run_id: str) -> RunPaths:
    """The paths of ``run_id``'s directory; refuses one that another run id created."""
    paths = RunPaths(hetflow_home() / "runs" / run_dir_name(run_id))
    try:
        owner = paths.owner.read_text()
    except FileNotFoundError:
        return paths
    if owner != run_id:
        raise RunDirectoryTaken(f"run directory {paths.root} belongs to run {owner!r}, not to run {run_id!r}")
    return paths


def create_run_dir(run_id: str) -> RunPaths:
    """Create ``run_id``'s directory, or re-use it if it is this run's, recording the real run id in it.

    The id goes into a temporary file that is then hard-linked into place: a link fails if the name
    exists, so of two runs that create one directory at once, one claims it and the other is refused.
    """
    paths = run_paths(run_id)
    paths.root.mkdir(parents=True, exist_ok=True)
    temporary = paths.root / f".run_id.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    temporary.write_text(run_id)
    try:
        os.link(temporary, paths.owner)
    except FileExistsError:
        pass  # created before (a retry), or by a run racing this one: run_paths tells which
    finally:
        temporary.unlink()
    return run_paths(run_id)

"""Preparing a dataset for the prepare_data task: built once with TFDS into the shared data dir, fingerprinted.

Runs share the data dir and may prepare at the same moment: each dataset is prepared under a file
lock of its own, and the index of current fingerprints is rewritten under another.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import hashlib
import json
import os
import re
from pathlib import Path

from hetflow.paths import RunPaths, write_record
from hetflow.paths import data_dir as shared_data_dir
from hetflow.records import DatasetRecord
from hetflow.spec.data_roots import as_checked, confined, data_roots

# Builders that need no network. Importing their module registers them with TFDS. Image folders
# (``folder:PATH``, hetflow.data.image_folder) need none either.
OFFLINE_DATASETS = ("uci_digits", "synthetic_cifar")

# Beside the shards: the fingerprint and each shard's SHA-256, recorded when they were prepared.
_FINGERPRINT_CACHE = "hetflow_fingerprint.json"
# The last fingerprint prepared of each dataset, to tell new data from re-used or re-built data.
_CURRENT_FINGERPRINTS = "hetflow_fingerprints.json"


def dataset_dir(spec) -> Path:
    """Where the run's TFDS datasets and image folders are prepared: the spec's data_dir, else the
    data dir every run shares; resolved, and checked under the allowed roots as resolved, so that
    what is prepared, recorded and shown to replicas is that folder, whatever a link along the spec's
    path points at later."""
    return confined(str(spec.data.data_dir or shared_data_dir()), "data_dir", data_roots())


def shown_to_replicas(run_dir: Path, data_dir: Path) -> list[Path]:
    """The prepared data a run's replicas see: the one version folder dataset.json records (what
    ``hetflow.data.pipeline`` reads), not the other datasets and versions of the data dir, as it
    was recorded resolved; refused (one line) when it now resolves elsewhere or lies outside
    ``data_dir``. Nothing before prepare_data has recorded it."""
    paths = RunPaths(run_dir)
    if not paths.dataset.exists():
        return []
    return [as_checked(DatasetRecord.read(paths).prepared_dir, str(data_dir), "prepared data")]


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive ``flock`` on ``path`` (created if missing); other processes wait for it.
    The kernel drops the lock when its holder exits, so a killed run leaves no stale lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as error:
        raise ValueError(
            f"data dir {path.parent} is not writable ({error.strerror}); set HETFLOW_HOME to a writable directory"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _builder(name: str, data_dir: Path):
    import tensorflow_datasets as tfds

    import hetflow.data.synthetic_images  # noqa: F401  (registers the offline builder)
    import hetflow.data.uci_digits  # noqa: F401  (registers the offline builder)

    try:
        return tfds.builder(name, data_dir=str(data_dir))
    except tfds.core.registered.DatasetNotFoundError:
        raise ValueError(_not_a_dataset(name)) from None


def _not_a_dataset(name: str) -> str:
    import tensorflow_datasets as tfds

    known = [*OFFLINE_DATASETS, *tfds.list_builders(with_community_datasets=False)]
    close = difflib.get_close_matches(name.split(":")[0].split("/")[0], known, n=3)
    return (
        f"dataset={name!r} is not a TFDS dataset{f' (did you mean {close[0]}?)' if close else ''}; "
        f"offline datasets: {', '.join(OFFLINE_DATASETS)}"
    )


def name_problems(name: str) -> list[str]:
    """Whether TFDS knows the dataset ``name``, as one line, reading no file and no network: what the
    trigger check can tell before a run exists (a folder's images and a download are validate_spec's)."""
    import tensorflow_datasets as tfds

    if name.startswith(FOLDER_PREFIX) or name.split(":")[0] in OFFLINE_DATASETS:
        return []
    try:
        tfds.builder_cls(name.split(":")[0].split("/")[0])
    except tfds.core.registered.DatasetNotFoundError:
        return [_not_a_dataset(name)]
    return []


def _shard_files(version_dir: Path) -> list[Path]:
    return sorted(p for p in version_dir.iterdir() if ".tfrecord-" in p.name or ".array_record-" in p.name)


def _digests(version_dir: Path) -> tuple[str, dict[str, str]]:
    """The dataset's fingerprint (SHA-256 over every shard's name and bytes, in name order) and each
    shard's own SHA-256, read in one pass."""
    fingerprint, shards = hashlib.sha256(), {}
    for shard in _shard_files(version_dir):
        own = hashlib.sha256()
        fingerprint.update(shard.name.encode())
        with shard.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                fingerprint.update(block)
                own.update(block)
        shards[shard.name] = own.hexdigest()
    return fingerprint.hexdigest(), shards


def verify_shards(info, version_dir: Path) -> None:
    """Read every TFRecord shard and compare its record count with what TFDS recorded; a corrupt
    or truncated shard raises, naming the file."""
    import tensorflow as tf

    for split in info.splits.values():
        for filename, expected in zip(split.filenames, split.shard_lengths):
            path = version_dir / filename
            try:
                found = int(tf.data.TFRecordDataset(str(path)).reduce(0, lambda count, _: count + 1))
            except (tf.errors.DataLossError, tf.errors.NotFoundError) as error:
                found, detail = None, error.message.splitlines()[0]
            else:
                detail = f"{found} records, {expected} expected"
            if found != expected:
                raise ValueError(
                    f"corrupt or truncated data shard {path} ({detail}); delete {version_dir} to prepare it again"
                )


def _fingerprint(info, version_dir: Path) -> str:
    """The fingerprint of the prepared shards, checked against their content as recorded at
    preparation: a shard changed in place (same name, size, even mtime) must not keep the old
    fingerprint, or the champion gate would compare against the wrong baseline. Shards never
    recorded (prepared before hetflow recorded them) are checked for record counts, then recorded."""
    cache = version_dir / _FINGERPRINT_CACHE
    fingerprint, shards = _digests(version_dir)
    recorded = json.loads(cache.read_text()) if cache.exists() else {}
    if "shards" not in recorded:
        verify_shards(info, version_dir)
        write_record(cache, {"fingerprint": fingerprint, "shards": shards})
        return fingerprint
    if shards != recorded["shards"]:
        verify_shards(info, version_dir)  # a truncated or corrupt shard is named as such
        names = sorted(shards.keys() | recorded["shards"].keys())
        changed = next(name for name in names if shards.get(name) != recorded["shards"].get(name))
        raise ValueError(
            f"data shard {version_dir / changed} changed since it was prepared (its SHA-256 differs from the one "
            f"recorded in {cache}); delete {version_dir} to prepare it again"
        )
    return fingerprint


def fingerprint_changed(data_dir: Path, name: str, fingerprint: str) -> bool:
    """Record ``fingerprint`` as ``name``'s current one; True when it replaces a different one (new
    data: hetflow_retrain is triggered), False when it is unchanged or the dataset is new here."""
    path = data_dir / _CURRENT_FINGERPRINTS
    # Read, change, write under one lock: two runs recording two datasets must both be kept.
    with _locked(data_dir / f".{_CURRENT_FINGERPRINTS}.lock"):
        current = json.loads(path.read_text()) if path.exists() else {}
        previous = current.get(name)
        if previous != fingerprint:
            current[name] = fingerprint
            write_record(path, current)
    return previous is not None and previous != fingerprint


FOLDER_PREFIX = "folder:"
# Where TFDS downloads from; checked before a download is attempted, so that a machine without network
# is told so while the spec is validated, not by a traceback from prepare_data.
_DOWNLOAD_HOST = ("storage.googleapis.com", 443)


def _network_reachable(timeout: float = 3.0) -> bool:
    import socket

    try:
        socket.create_connection(_DOWNLOAD_HOST, timeout=timeout).close()
        return True
    except OSError:
        return False


def check_available(name: str, data_dir: Path, image_size: str | None = None) -> None:
    """Raise ValueError (one line) when ``name`` cannot be prepared here, before any replica starts:
    an image folder with bad data (see ``image_folder.scan``), a name TFDS does not know, or a dataset
    that is not prepared in ``data_dir`` while the network it would be downloaded from is unreachable."""
    if name.startswith(FOLDER_PREFIX):
        from hetflow.data.image_folder import scan

        scan(name[len(FOLDER_PREFIX) :], image_size)
        return
    if name.split(":")[0] in OFFLINE_DATASETS:
        return
    builder = _builder(name, data_dir)
    if not builder.is_prepared() and not _network_reachable():
        raise ValueError(
            f"dataset={name} is not prepared in data_dir {data_dir} and {_DOWNLOAD_HOST[0]} is unreachable: "
            f"prepare it on a machine with network (`tfds build {name.split(':')[0]} --data_dir DIR`) and copy "
            f"DIR's contents into {data_dir}"
        )


def data_problems(spec) -> list[str]:
    """What keeps the spec's dataset from being prepared here (bad images, an unknown name, no
    network for a download), as one line; checked before anything starts."""
    try:
        check_available(spec.data.dataset, dataset_dir(spec), spec.data.image_size)
    except ValueError as error:
        return [str(error)]
    return []


def prepare_dataset(name: str, data_dir: Path, image_size: str | None = None) -> DatasetRecord:
    """Download (where needed) and prepare ``name`` under ``data_dir``; re-use it when already there.

    Returns what later stages need: where the prepared dataset is, split sizes, input shape, classes
    and the fingerprint of the prepared files, and whether that fingerprint is new data.
    """
    import tensorflow_datasets as tfds

    if name.startswith(FOLDER_PREFIX):
        from hetflow.data import image_folder

        inventory = image_folder.scan(name[len(FOLDER_PREFIX) :], image_size)
        identity, source = f"{FOLDER_PREFIX}{inventory.folder}", str(inventory.folder)
        family = f"folder_{inventory.config_name}"
        version_suffix = f"+{inventory.content_digest[:12]}"  # the folder's content is part of the data's version

        def make_builder():
            return image_folder.builder(inventory, data_dir)
    else:
        identity, source, version_suffix = name.split(":")[0], None, ""
        family = re.sub(r"[^A-Za-z0-9_]", "_", re.split(r"[:/]", name)[0])

        def make_builder():
            return _builder(name, data_dir)

    # One lock per dataset, whatever the version or config asked for: two processes preparing one
    # dataset at once would both build it, and the second fail to move its copy into place. The
    # builder is made under the lock, so that it sees what the lock's previous holder prepared.
    with _locked(data_dir / f".{family}.lock"):
        builder = make_builder()
        prepared_before = builder.is_prepared()
        if not prepared_before:
            shards = getattr(builder, "NUM_SHARDS", None)
            builder.download_and_prepare(download_config=tfds.download.DownloadConfig(num_shards=shards))
        info = builder.info
        # Recorded, and later shown to replicas, as the folder the shards were checked in.
        version_dir = as_checked(str(builder.data_dir), str(data_dir), "prepared data")
        fingerprint = _fingerprint(info, version_dir)
    image_key, label_key = info.supervised_keys
    return DatasetRecord(
        name=identity,
        version=f"{info.version}{version_suffix}",
        data_dir=str(data_dir),
        prepared_dir=str(version_dir),
        # What the data was prepared from: the image folder, or TFDS's prepared copy.
        source_path=source or str(version_dir),
        reused=prepared_before,
        splits={split: info.splits[split].num_examples for split in info.splits},
        shards={split: info.splits[split].num_shards for split in info.splits},
        input_shape=list(info.features[image_key].shape),
        num_classes=info.features[label_key].num_classes,
        class_names=info.features[label_key].names,
        fingerprint=fingerprint,
        data_changed=fingerprint_changed(data_dir, identity, fingerprint),
    )

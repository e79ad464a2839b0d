"""prepare_data: build a TFDS dataset once into the shared data dir and fingerprint it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

# Builders that need no network. Importing their module registers them with TFDS.
OFFLINE_DATASETS = ("uci_digits", "synthetic_cifar")

_FINGERPRINT_CACHE = "hetflow_fingerprint.json"
# The last fingerprint prepared of each dataset, to tell new data from re-used or re-built data.
_CURRENT_FINGERPRINTS = "hetflow_fingerprints.json"


def _builder(name: str, data_dir: Path):
    import tensorflow_datasets as tfds

    import tasks.data.synthetic_images  # noqa: F401  (registers the offline builder)
    import tasks.data.uci_digits  # noqa: F401  (registers the offline builder)

    try:
        return tfds.builder(name, data_dir=str(data_dir))
    except tfds.core.registered.DatasetNotFoundError:
        raise ValueError(
            f"dataset={name!r} is not a TFDS dataset; offline datasets: {', '.join(OFFLINE_DATASETS)}"
        ) from None


def _shard_files(version_dir: Path) -> list[Path]:
    return sorted(p for p in version_dir.iterdir() if ".tfrecord-" in p.name or ".array_record-" in p.name)


def _cached_fingerprint(version_dir: Path) -> str | None:
    """The recorded fingerprint, if the shard files are still the ones it was computed from."""
    cache = version_dir / _FINGERPRINT_CACHE
    if not cache.exists():
        return None
    cached = json.loads(cache.read_text())
    listing = {p.name: p.stat().st_size for p in _shard_files(version_dir)}
    return cached["fingerprint"] if cached["files"] == listing else None


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


def _fingerprint(version_dir: Path) -> str:
    """SHA-256 over the prepared shard files (names and bytes), cached beside them by name and size."""
    cached = _cached_fingerprint(version_dir)
    if cached is not None:
        return cached
    shards = _shard_files(version_dir)
    listing = {p.name: p.stat().st_size for p in shards}
    cache = version_dir / _FINGERPRINT_CACHE
    digest = hashlib.sha256()
    for shard in shards:
        digest.update(shard.name.encode())
        with shard.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    fingerprint = digest.hexdigest()
    cache.write_text(json.dumps({"files": listing, "fingerprint": fingerprint}, indent=2))
    return fingerprint


def fingerprint_changed(data_dir: Path, name: str, fingerprint: str) -> bool:
    """Record ``fingerprint`` as ``name``'s current one; True when it replaces a different one (new
    data: hetflow_retrain is triggered), False when it is unchanged or the dataset is new here."""
    path = data_dir / _CURRENT_FINGERPRINTS
    current = json.loads(path.read_text()) if path.exists() else {}
    previous = current.get(name)
    if previous != fingerprint:
        current[name] = fingerprint
        path.write_text(json.dumps(current, indent=2))
    return previous is not None and previous != fingerprint


def _check_writable(data_dir: Path) -> None:
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        probe = data_dir / ".hetflow-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ValueError(
            f"data dir {data_dir} is not writable ({error.strerror}); set HETFLOW_HOME to a writable directory"
        ) from None


def prepare_dataset(name: str, data_dir: Path) -> dict[str, Any]:
    """Download (where needed) and prepare ``name`` under ``data_dir``; re-use it when already there.

    Returns what later stages need: the versioned name to load, split sizes, input shape, classes
    and the fingerprint of the prepared files, and whether that fingerprint is new data.
    """
    import tensorflow_datasets as tfds

    builder = _builder(name, data_dir)
    prepared_before = builder.is_prepared()
    if prepared_before and _cached_fingerprint(Path(builder.data_dir)) is None:
        # The files changed since they were fingerprinted (or never were): check them first.
        verify_shards(builder.info, Path(builder.data_dir))
    if not prepared_before:
        _check_writable(data_dir)
        shards = getattr(builder, "NUM_SHARDS", None)
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(num_shards=shards))
    info = builder.info
    image_key, label_key = info.supervised_keys
    version_dir = Path(builder.data_dir)
    fingerprint = _fingerprint(version_dir)
    return {
        "name": info.name,
        "version": str(info.version),
        "load_name": f"{info.name}:{info.version}",
        "data_dir": str(data_dir),
        "prepared_dir": str(version_dir),
        "reused": prepared_before,
        "splits": {split: info.splits[split].num_examples for split in info.splits},
        "shards": {split: info.splits[split].num_shards for split in info.splits},
        "input_shape": list(info.features[image_key].shape),
        "num_classes": info.features[label_key].num_classes,
        "fingerprint": fingerprint,
        "data_changed": fingerprint_changed(data_dir, info.name, fingerprint),
    }

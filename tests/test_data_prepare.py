"""prepare_data and the input pipeline, on the offline digits dataset."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from hetflow.data.prepare import prepare_dataset

    data_dir = tmp_path_factory.mktemp("data")
    return data_dir, prepare_dataset("uci_digits", data_dir)


def test_prepare_builds_versioned_sharded_splits(prepared):
    data_dir, record = prepared
    assert (record.name, record.version) == ("uci_digits", "1.0.0")
    assert record.prepared_dir == record.source_path == str(data_dir / "uci_digits" / "1.0.0")
    assert record.splits == {"train": 1258, "validation": 180, "test": 359}
    assert sum(record.splits.values()) == 1797  # every sklearn digit, each in one split
    assert record.shards == {"train": 4, "validation": 4, "test": 4}
    assert (record.input_shape, record.num_classes) == ([8, 8, 1], 10)
    assert len(record.fingerprint) == 64 and not record.reused


def test_prepare_is_idempotent_and_the_fingerprint_stable(prepared):
    from hetflow.data.prepare import prepare_dataset

    data_dir, first = prepared
    shard = next(p for p in (data_dir / "uci_digits" / "1.0.0").iterdir() if ".tfrecord-" in p.name)
    mtime = shard.stat().st_mtime_ns
    again = prepare_dataset("uci_digits", data_dir)
    assert again.reused and again.fingerprint == first.fingerprint
    assert shard.stat().st_mtime_ns == mtime


def test_fingerprint_changes_with_the_data(prepared, tmp_path):
    import shutil

    from hetflow.data.prepare import _digests

    data_dir, record = prepared
    copy = tmp_path / "copy"
    shutil.copytree(data_dir / "uci_digits" / "1.0.0", copy)
    assert _digests(copy)[0] == record.fingerprint
    shard = sorted(copy.glob("*train.tfrecord-*"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    assert _digests(copy)[0] != record.fingerprint


def _flip_a_byte_in_place(path):
    """Change one byte of ``path`` and give it back its size and mtime: what a disk error, or a tool
    that rewrites a file and keeps its times, leaves behind."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_a_shard_changed_in_place_is_named_not_reused(tmp_path):
    from hetflow.data.prepare import prepare_dataset

    first = prepare_dataset("uci_digits", tmp_path)
    version_dir = tmp_path / "uci_digits" / "1.0.0"
    shard = sorted(version_dir.glob("uci_digits-test.tfrecord-*"))[2]
    _flip_a_byte_in_place(shard)
    with pytest.raises(ValueError) as refused:
        prepare_dataset("uci_digits", tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    # TFRecord checksums catch a flipped byte; the shard is named either way, and the fix given.
    assert f"data shard {shard} " in message and f"delete {version_dir} to prepare it again" in message
    assert len(list(version_dir.glob("*.tfrecord-*"))) == 12  # nothing deleted behind the user's back
    # The index still holds the fingerprint of the data as prepared.
    index = json.loads((tmp_path / "hetflow_fingerprints.json").read_text())
    assert index == {"uci_digits": first.fingerprint}


def test_a_shard_rewritten_with_valid_records_is_named(tmp_path):
    """Its records reordered: valid checksums, the same count and size, only the content differs,
    which only the content hash recorded at preparation tells."""
    import tensorflow as tf

    from hetflow.data.prepare import prepare_dataset

    prepare_dataset("uci_digits", tmp_path)
    version_dir = tmp_path / "uci_digits" / "1.0.0"
    shard = sorted(version_dir.glob("uci_digits-train.tfrecord-*"))[1]
    before = shard.stat()
    records = [r.numpy() for r in tf.data.TFRecordDataset(str(shard))]
    with tf.io.TFRecordWriter(str(shard)) as writer:
        for record in reversed(records):
            writer.write(record)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (shard.stat().st_size, shard.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with pytest.raises(ValueError, match=rf"^data shard {shard} changed since it was prepared .*delete {version_dir}"):
        prepare_dataset("uci_digits", tmp_path)


def test_tfds_load_by_name_gives_raw_uint8_images(prepared):
    import tensorflow_datasets as tfds

    import hetflow.data.uci_digits  # noqa: F401

    data_dir, _ = prepared
    images, labels = tfds.as_numpy(
        tfds.load("uci_digits", split="test", data_dir=str(data_dir), as_supervised=True, batch_size=-1)
    )
    assert images.shape == (359, 8, 8, 1) and images.dtype == np.uint8
    assert images.max() == 255 and images.min() == 0
    assert sorted(set(labels.tolist())) == list(range(10))


def test_unknown_dataset_names_the_offline_ones(tmp_path):
    from hetflow.data.prepare import prepare_dataset

    with pytest.raises(ValueError, match="dataset='no_such_set' is not a TFDS dataset; offline datasets: uci_digits"):
        prepare_dataset("no_such_set", tmp_path)


def test_worker_shards_partition_the_global_batch(prepared):
    """Union of the workers' k-th batches == the single worker's k-th batch (same seed, shuffled)."""
    from hetflow.data.pipeline import train_input

    _, record = prepared
    steps, global_batch = 3, 8

    def batches(num_workers, index):
        pipeline = train_input(
            record,
            per_worker_batch=global_batch // num_workers,
            shuffle=True,
            seed=7,
            num_workers=num_workers,
            worker_index=index,
        )
        return [images.numpy() for images, _ in pipeline.take(steps)]

    single = batches(1, 0)
    shards = [batches(2, 0), batches(2, 1)]
    for step in range(steps):
        union = np.concatenate([shards[0][step], shards[1][step]])
        as_rows = lambda a: sorted(map(bytes, a.reshape(len(a), -1)))  # noqa: E731
        assert as_rows(union) == as_rows(single[step])

"""The tf.data input pipeline every strategy shares."""

from __future__ import annotations

import functools
import os
from typing import Any, Iterator

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from hetflow.records import DatasetRecord
from hetflow.spec.sections import CACHE_BUDGET_MB, SHUFFLE_BUFFER


@functools.lru_cache(maxsize=8)
def _prepared(prepared_dir: str):
    """The prepared dataset, read from its directory alone (its dataset_info.json and shards): no
    builder code is needed to read it, which is what lets image folders' builders stay unregistered."""
    return tfds.builder_from_directory(prepared_dir)


def _without_autotuning_thread(examples: tf.data.Dataset) -> tf.data.Dataset:
    """``examples`` with tf.data's autotuning model thread off (prefetch still sizes its own buffer).

    Destroying an iterator cancels that thread and waits for it, and the cancellation can be missed:
    the thread wakes, sees the cancellation not yet marked done and sleeps out its optimization
    period again, which doubles up to 60 s on a long-lived iterator. A replica pinned to one core
    lost that race nearly every time: between its last epoch and its final weights it waited up to
    tens of seconds (gdb: the main thread in ``~RootDataset::Iterator``, the model thread in
    ``Model::OptimizeLoop``'s timed wait). The pipelines here have nothing else for it to tune."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return examples.with_options(options)


def _load(dataset: DatasetRecord, split: str) -> tf.data.Dataset:
    # Without TFDS's own cache of small datasets: the inputs here cache what they read themselves,
    # and a part of a split (a worker's validation examples) read through TFDS's cache left it
    # unfinished, which TensorFlow warns about and throws away. as_dataset is left to run as it is
    # where a strategy traces the input (parameter_server's per-worker datasets): AutoGraph cannot
    # convert a wrapt-decorated method and warns that it will not.
    as_dataset = tf.autograph.experimental.do_not_convert(_prepared(dataset.prepared_dir).as_dataset)
    read_config = tfds.ReadConfig(try_autocache=False)
    return as_dataset(split=split, as_supervised=True, shuffle_files=False, read_config=read_config)


def example_bytes(dataset: DatasetRecord) -> int:
    """One decoded example's bytes: its uint8 image and int64 label."""
    return int(np.prod(dataset.input_shape)) + 8


def fits_cache(dataset: DatasetRecord, examples: int, cache_budget_mb: int) -> bool:
    """Whether ``examples`` decoded examples of ``dataset`` fit a cache of ``cache_budget_mb``."""
    return examples * example_bytes(dataset) <= cache_budget_mb * 2**20


def training_input(
    dataset: DatasetRecord, shuffle_buffer: int = SHUFFLE_BUFFER, cache_budget_mb: int = CACHE_BUDGET_MB
) -> dict[str, Any]:
    """How the training split is read (training.json's ``training_input``): ``cached`` in memory where
    its decoded examples fit ``cache_budget_mb``, else ``streamed`` from the prepared files every
    epoch; and the shuffle buffer used, the split's size where it is smaller than ``shuffle_buffer``."""
    split_bytes, budget = dataset.splits["train"] * example_bytes(dataset), cache_budget_mb * 2**20
    return {
        "mode": "cached" if fits_cache(dataset, dataset.splits["train"], cache_budget_mb) else "streamed",
        "split_bytes": split_bytes,
        "cache_budget_bytes": budget,
        "shuffle_buffer": min(shuffle_buffer, dataset.splits["train"]),
    }


def validation_input(dataset: DatasetRecord, examples: int, cache_budget_mb: int = CACHE_BUDGET_MB) -> dict[str, Any]:
    """How a replica validating on ``examples`` of the validation split reads them (training.json's
    ``validation_input``, as ``eval_input`` does): ``cached`` after the first pass where they fit
    ``cache_budget_mb``, else ``streamed`` from the prepared files every pass."""
    return {
        "mode": "cached" if fits_cache(dataset, examples, cache_budget_mb) else "streamed",
        "examples": examples,
        "bytes": examples * example_bytes(dataset),
    }


def train_input(
    dataset: DatasetRecord,
    *,
    per_worker_batch: int,
    shuffle: bool,
    seed: int,
    shuffle_buffer: int = SHUFFLE_BUFFER,
    cache_budget_mb: int = CACHE_BUDGET_MB,
    num_workers: int = 1,
    worker_index: int = 0,
) -> tf.data.Dataset:
    """Endless, shuffled, per-worker sharded training batches.

    Every worker shuffles with the same seed, then keeps every ``num_workers``-th element: so the
    union of the workers' k-th batches is exactly the k-th batch one worker with the global batch
    would see, whatever the number of workers (what makes sync training match single-replica
    training). Endless, so every worker yields the same number of batches per epoch
    (``steps_per_epoch`` decides where an epoch ends). The shuffle holds at most ``shuffle_buffer``
    examples, and the split is cached only where it fits ``cache_budget_mb`` (``training_input``).
    """
    examples = _training_examples(dataset, shuffle, seed, training_input(dataset, shuffle_buffer, cache_budget_mb))
    if num_workers > 1:
        examples = examples.shard(num_workers, worker_index)
    return _without_autotuning_thread(examples.batch(per_worker_batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))


def _check_slice(start: int, end: int, global_batch: int) -> None:
    if not 0 <= start < end <= global_batch:
        raise ValueError(f"examples {start}:{end} are not a slice of a global batch of {global_batch}")


def train_slices(
    examples: tuple[tf.Tensor, tf.Tensor],
    *,
    start: int,
    end: int,
    global_batch: int,
    shuffle: bool,
    seed: int,
    shuffle_buffer: int = SHUFFLE_BUFFER,
) -> tf.data.Dataset:
    """Endless training batches of the examples ``start:end`` of each global batch, from the
    training split's ``examples`` (``training_tensors``: loaded once, however often the shares change).

    For workers with unequal shares of the global batch (balanced sync). Every worker shuffles the
    example *indices* with the same seed and buffer as ``train_input`` shuffles the examples (tf.data's
    order depends on the seed, the buffer and the count, not on the elements), groups them into global
    batches and gathers only the examples at its own positions: the slices of the workers' k-th
    batches, in order, are exactly the k-th batch of one worker with the global batch, and a worker
    reads only its own share of each.
    """
    _check_slice(start, end, global_batch)
    images, labels = examples
    count = int(labels.shape[0])
    indices = tf.data.Dataset.range(count)
    if shuffle:
        indices = indices.shuffle(min(shuffle_buffer, count), seed=seed, reshuffle_each_iteration=True)
    mine = indices.repeat().batch(global_batch, drop_remainder=True).map(lambda batch: batch[start:end])
    batches = mine.map(lambda positions: (tf.gather(images, positions), tf.gather(labels, positions)))
    return _without_autotuning_thread(batches.prefetch(tf.data.AUTOTUNE))


def share_examples(dataset: DatasetRecord, start: int, end: int, global_batch: int) -> tuple[int, int]:
    """The training examples (first, last) that the share ``start:end`` of each global batch reads
    when the split streams (``share_input``): the split cut in proportion to the shares, so the
    shares' ranges are disjoint, cover the split, and each holds at least what its share takes of
    an epoch (floor(S*end/B) - floor(S*start/B) >= floor(S*(end-start)/B))."""
    count = dataset.splits["train"]
    return count * start // global_batch, count * end // global_batch


def share_input(
    dataset: DatasetRecord,
    *,
    start: int,
    end: int,
    global_batch: int,
    shuffle: bool,
    seed: int,
    shuffle_buffer: int = SHUFFLE_BUFFER,
) -> tf.data.Dataset:
    """Endless batches of ``end - start`` examples drawn only from this share's own range of the
    training split (``share_examples``, ``range_input``). For a split too large to cache.

    No example is in two shares' batches of a step, and each pass over a share's range reads each
    of its examples once; unlike ``train_slices``, N workers do not see the batches one worker
    would (each shuffles only its own range).
    """
    _check_slice(start, end, global_batch)
    first, last = share_examples(dataset, start, end, global_batch)
    return range_input(
        dataset, first, last, batch=end - start, shuffle=shuffle, seed=seed, shuffle_buffer=shuffle_buffer
    )


def range_input(
    dataset: DatasetRecord,
    first: int,
    last: int,
    *,
    batch: int,
    shuffle: bool,
    seed: int | None,
    shuffle_buffer: int = SHUFFLE_BUFFER,
    cache: bool = False,
) -> tf.data.Dataset:
    """Endless batches of ``batch`` training examples drawn only from the examples ``first:last``:
    TFDS opens only the TFRecord files that hold that range, so a worker reads about its part of
    the split, not all of it. ``cache`` keeps the range's decoded examples after the first pass."""
    examples = _load(dataset, f"train[{first}:{last}]")
    if cache:
        examples = examples.cache()
    if shuffle:
        examples = examples.shuffle(min(shuffle_buffer, last - first), seed=seed, reshuffle_each_iteration=True)
    batches = examples.repeat().batch(batch, drop_remainder=True)
    return _without_autotuning_thread(batches.prefetch(tf.data.AUTOTUNE))


def share_read(dataset: DatasetRecord, start: int, end: int, global_batch: int) -> dict[str, Any]:
    """What ``share_input`` reads per pass over its range (``range_read``)."""
    return range_read(dataset, *share_examples(dataset, start, end, global_batch))


def range_read(dataset: DatasetRecord, first: int, last: int) -> dict[str, Any]:
    """What ``range_input`` reads per pass over ``first:last`` (training.json's per_worker read_
    fields): its examples, the TFRecord files it opens and their bytes (an upper bound: a file it
    shares with a neighbour is read only up to the end of its range)."""
    files = _prepared(dataset.prepared_dir).info.splits[f"train[{first}:{last}]"].file_instructions
    return {
        "read_examples": last - first,
        "read_files": [os.path.basename(file.filename) for file in files],
        "read_file_bytes": sum(os.path.getsize(file.filename) for file in files),
    }


def _training_examples(dataset: DatasetRecord, shuffle: bool, seed: int, how: dict[str, Any]) -> tf.data.Dataset:
    examples = _load(dataset, "train")
    if how["mode"] == "cached":
        examples = examples.cache()
    if shuffle:
        examples = examples.shuffle(how["shuffle_buffer"], seed=seed, reshuffle_each_iteration=True)
    return examples.repeat()


def eval_input(
    dataset: DatasetRecord,
    split: str,
    batch_size: int = 256,
    examples: tuple[int, int] | None = None,
    cache_budget_mb: int = CACHE_BUDGET_MB,
) -> tf.data.Dataset:
    """An ordered pass over ``split`` (or over its examples ``start:end``) each time it is iterated,
    for validation: cached after the first pass where those examples fit ``cache_budget_mb``, else
    read from the prepared files every pass."""
    ordered = _load(dataset, split)
    start, end = examples if examples is not None else (0, dataset.splits[split])
    if examples is not None:
        ordered = ordered.skip(start).take(end - start)
    if fits_cache(dataset, end - start, cache_budget_mb):
        ordered = ordered.cache()
    return _without_autotuning_thread(ordered.batch(batch_size).prefetch(tf.data.AUTOTUNE))


def training_tensors(dataset: DatasetRecord) -> tuple[tf.Tensor, tf.Tensor]:
    """The training split's images and labels as tensors, for ``train_slices``."""
    images, labels = split_arrays(dataset, "train")
    return tf.convert_to_tensor(images), tf.convert_to_tensor(labels)


def split_arrays(dataset: DatasetRecord, split: str) -> tuple[Any, Any]:
    """The whole split as numpy arrays (images uint8, labels int64): its memory grows with the split,
    so only for ``training_tensors`` and the benches; the stages stream (``split_batches``)."""
    images, labels = tfds.as_numpy(_load(dataset, split).batch(dataset.splits[split]).get_single_element())
    return images, labels


# What a stage that scores a split holds of it at once, in examples (export's parity checks compare
# every artifact on the same batch): its memory is one batch's, whatever the split's size.
SCORING_BATCH = 256


def streamed_input(dataset: DatasetRecord, split: str, batch_size: int = SCORING_BATCH) -> tf.data.Dataset:
    """One ordered pass over ``split`` in batches of ``batch_size``, read from the prepared files as it
    goes (no cache): for Keras where it takes a dataset (fine-tuning's validation)."""
    return _without_autotuning_thread(_load(dataset, split).batch(batch_size).prefetch(1))


def split_batches(
    dataset: DatasetRecord, split: str, batch_size: int = SCORING_BATCH
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``streamed_input`` as numpy batches (images uint8, labels int64)."""
    return iter(tfds.as_numpy(streamed_input(dataset, split, batch_size)))


def split_head(dataset: DatasetRecord, split: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``count`` examples of ``split`` in order (all of them where it has fewer)."""
    return tfds.as_numpy(_load(dataset, split).take(count).batch(count).get_single_element())


def split_images_at(dataset: DatasetRecord, split: str, positions: np.ndarray) -> np.ndarray:
    """The images at ``positions`` (distinct) of ``split``, in the order given, gathered in one
    streaming pass that stops after the last of them."""
    order = np.argsort(positions, kind="stable")
    wanted = positions[order]
    images, found, start = None, 0, 0
    for batch, _ in split_batches(dataset, split):
        end = start + len(batch)
        upto = int(np.searchsorted(wanted, end))  # wanted[found:upto] lie in this batch
        if images is None:
            images = np.empty((len(positions), *batch.shape[1:]), batch.dtype)
        images[order[found:upto]] = batch[wanted[found:upto] - start]
        found, start = upto, end
        if found == len(wanted):
            break
    if found < len(wanted):
        raise ValueError(f"positions up to {int(wanted[-1])} asked of split {split!r}, which has {start} examples")
    return images

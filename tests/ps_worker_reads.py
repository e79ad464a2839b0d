"""Which training examples each parameter-server worker's iterator yields, for
test_data_training_input.py: ``python ps_worker_reads.py DATASET_JSON`` starts a ps and two workers as
in-process gRPC servers on 127.0.0.1 (a process of its own: a coordinator reconfigures its process's
eager context for good), builds each worker's iterator as the async chief does
(``parameter_server._per_worker_iterators`` over ``range_input`` on the worker's half of the split),
schedules steps that each take one batch, and prints one JSON line: for each worker, the half of
the split each example it yielded belongs to (read back as TFDS reads ``train[first:last]``)."""

from __future__ import annotations

import json
import os
import socket
import sys

import tensorflow as tf

from hetflow.data.pipeline import range_input, share_examples, split_head
from hetflow.records import DatasetRecord
from hetflow.replica.parameter_server import _per_worker_ids, _per_worker_iterators

WORKERS, BATCH, STEPS = 2, 17, 40


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(dataset: DatasetRecord) -> dict[str, list[int]]:
    cluster = tf.train.ClusterSpec(
        {job: [f"127.0.0.1:{_free_port()}" for _ in range(count)] for job, count in (("worker", WORKERS), ("ps", 1))}
    )
    for job, count in (("worker", WORKERS), ("ps", 1)):
        for index in range(count):
            tf.distribute.Server(cluster, job_name=job, task_index=index, protocol="grpc", start=True)
    strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.SimpleClusterResolver(cluster))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    def worker_batches(worker: int) -> tf.data.Dataset:
        first, last = share_examples(dataset, worker, worker + 1, WORKERS)
        return range_input(dataset, first, last, batch=BATCH, shuffle=True, seed=worker, shuffle_buffer=64)

    iterators, worker_ids = _per_worker_iterators(coordinator, worker_batches), _per_worker_ids(coordinator)
    take = tf.function(lambda iterator, worker_id: (next(iterator)[0], tf.identity(worker_id)))
    results = [coordinator.schedule(take, args=(iterators, worker_ids)) for _ in range(STEPS)]
    coordinator.join()
    half_of = {}
    for worker in range(WORKERS):
        first, last = share_examples(dataset, worker, worker + 1, WORKERS)
        images, _ = split_head(dataset, f"train[{first}:{last}]", last - first)
        half_of.update((image.tobytes(), worker) for image in images)
    assert len(half_of) == dataset.splits["train"]  # the digits' training images are distinct
    seen: dict[str, list[int]] = {}
    for result in results:
        batch, worker = result.fetch()
        seen.setdefault(f"worker-{int(worker)}", []).extend(half_of[image.tobytes()] for image in batch)
    return seen


if __name__ == "__main__":
    print(json.dumps(main(DatasetRecord.model_validate_json(sys.argv[1]))), flush=True)
    os._exit(0)  # the in-process servers' threads never end of themselves

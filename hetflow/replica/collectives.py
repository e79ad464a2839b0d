"""The all-reduce of a synchronous step, measured apart from the computation (training.json's
``collectives``).

Every step sums the replicas' gradients with ``reduce_gradients``: the strategy's own all-reduce,
with its ``CommunicationOptions``, which TensorFlow packs into ``bytes_per_pack``-sized
collectives (one for all of them where that is 0). What is recorded:

- ``collectives_per_step``, ``bytes_per_step`` and ``dtypes``: the all-reduce ops in the traced
  training step and what they carry (their inputs' sizes and types), read from its graph;
- ``seconds_per_step``: one step's all-reduce timed alone. Before the first step, every worker
  runs ``reduce_gradients`` on tensors of the gradients' shapes and types (the same function,
  strategy and options as the step), ``TIMED_REDUCTIONS`` times in a row after a warm-up,
  all workers starting together at a barrier collective; the time per reduction. The workers do
  nothing else meanwhile, so it is the cost of the collectives themselves (the transfers, the
  additions, the runtime's scheduling), not what they cost inside a step: it leaves out their
  overlap with the backward pass, their sharing of a core with it, and the time a worker waits
  for a slower one to reach the collective.

Only for multi_worker_mirrored: mirrored reduces by copying to one device (no collective ops),
and one_device reduces nothing.
"""

from __future__ import annotations

import time
from typing import Any

import tensorflow as tf

from hetflow.replica.record import tensor_bytes

# Ring all-reduce over gRPC between the workers named in TF_CONFIG (no NCCL on CPU); all of a
# step's gradients in one collective (bytes_per_pack=0).
COMMUNICATION = tf.distribute.experimental.CommunicationOptions(
    implementation=tf.distribute.experimental.CommunicationImplementation.RING
)
# The all-reduce ops TensorFlow's collectives emit (tf.raw_ops), older versions' included.
ALL_REDUCE_OPS = frozenset({"CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3"})
# Milliseconds each for the bench's convnet (bench/RESULTS.md: its all-reduce per step): a small
# part of a run's start-up.
TIMED_REDUCTIONS = 10


def reduce_gradients(gradients: list[tf.Tensor]) -> list[tf.Tensor]:
    """In a replica context: each gradient summed over all replicas (what a Keras optimizer's
    aggregation does, here where it can be timed alone)."""
    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, gradients)


def time_reduction(strategy: tf.distribute.Strategy, variables: list[tf.Variable], barrier) -> float:
    """Seconds per ``reduce_gradients`` of tensors shaped like ``variables``' gradients, run alone
    by every worker at once (``barrier()`` starts them together; see the module's docstring)."""
    tensors = [tf.zeros(variable.shape, variable.dtype) for variable in variables]
    reduce_alone = tf.function(lambda: strategy.run(reduce_gradients, args=(tensors,)))
    reduce_alone()  # traced, and the collectives' group and keys set up
    barrier()
    started = time.perf_counter()
    for _ in range(TIMED_REDUCTIONS):
        reduce_alone()
    return (time.perf_counter() - started) / TIMED_REDUCTIONS


def step_all_reduces(step: tf.types.experimental.ConcreteFunction) -> list[tf.Operation]:
    """The all-reduce ops in a traced step's graph."""
    return [op for op in step.graph.get_operations() if op.type in ALL_REDUCE_OPS]


def collectives_record(step: tf.types.experimental.ConcreteFunction, seconds_per_step: float) -> dict[str, Any]:
    """training.json's ``collectives``: the traced ``step``'s all-reduces and ``seconds_per_step``
    from ``time_reduction``."""
    reduced = [op.inputs[0] for op in step_all_reduces(step)]
    return {
        "seconds_per_step": seconds_per_step,
        "collectives_per_step": len(reduced),
        "bytes_per_step": tensor_bytes(reduced),
        "dtypes": sorted({tensor.dtype.name for tensor in reduced}),
        "implementation": COMMUNICATION.implementation.name,
        "bytes_per_pack": COMMUNICATION.bytes_per_pack,
        "timed_reductions": TIMED_REDUCTIONS,
    }

"""What model_parallel's chief measures before it splits the model (``plan_stages``): each layer's
forward and backward pass on a stage's device, each stage device's speed on a fixed piece of work,
and the seconds per byte between consecutive stages; the split itself is
``hetflow.models.stage_split``'s, which the pipeline recomputes from these numbers."""

from __future__ import annotations

import logging
import math
import statistics
import time

import tensorflow as tf

from hetflow.models.architectures import layer_chain
from hetflow.models.stage_split import (
    StageCosts,
    StageSplitPlan,
    StateLimits,
    chosen_split,
    split_by_parameters,
    stage_seconds,
)
from hetflow.records import DatasetRecord
from hetflow.spec import RunSpec, SpecError

# The fixed work each stage's device is timed on: chained matrix products, one round trip for all of
# them. A call is long (about 50 ms on one thread) so that it measures how much work a device gets
# through, not how soon it answers: at 16 products (3 ms), a worker with slowdown 2, stopped for
# 10 ms in every 20, timed 2.2x to 3.6x slower over six bench runs; the steps it ran matched 2x.
CALIBRATION_SIZE, CALIBRATION_PRODUCTS = 256, 256
# Timings add calls up to at least this long; a device's spans several of the kernel's 100 ms CPU
# quota periods, which is how a slower worker (worker_devices slowdown, replica_cpus) is held back.
LAYER_TIMING_SECONDS, DEVICE_TIMING_SECONDS = 0.1, 0.5
# A small layer's pass is repeated inside one call until the call takes about this long, so that the
# call's own overhead (a millisecond) does not make every small layer look alike; a large one is
# timed once (at a micro-batch of 1024, one wide_mlp layer's pass takes half a second: repeated 20
# times for each, they held the first step back by 100 s).
LAYER_CALL_SECONDS, MAX_LAYER_REPEATS = 0.02, 20
# A small layer's figure is the median of this many timings: one timing taken while something else
# held the core gave the convnet's conv2d_3 0.20 of the model's cost where two others gave 0.28, and
# that moved the cut.
LAYER_TIMINGS = 3
# The tensor each stage boundary is timed on: large enough that the call's fixed overhead (a
# millisecond) weighs little against the bytes.
TRANSFER_BYTES = 16 * 2**20


def _seconds_per_call(function, at_least: float) -> float:
    """Seconds per call of ``function`` (a tf.function, called once first to trace it), over calls
    adding up to ``at_least``; each call's results are fetched, so its work is done."""
    function()
    calls, started = 0, time.perf_counter()
    while True:
        tf.nest.map_structure(lambda tensor: tensor.numpy(), function())
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= at_least:
            return elapsed / calls


class _NotRetracing(logging.Filter):
    """Drops TensorFlow's warning that many functions were traced."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "triggered tf.function retracing" not in record.getMessage()


def profile_layers(kind: str, input_shape: list[int], num_classes: int, micro_batch: int, device: str) -> dict:
    """Each layer of the model (``layer_chain``): its name, parameters, output bytes, and the seconds
    its forward and backward pass of one micro-batch take on ``device``: a stage's, with the threads its replica has
    (timed on the chief's own threads, the convnet's last stage was given 0.34 of the cost where a
    one-thread stage spent 0.46). Built and timed one layer at a time, so no device ever holds the
    whole model that the stages share."""
    with tf.device(device):
        x = tf.zeros([micro_batch, *input_shape], tf.uint8)
    names, parameters, seconds, cut_bytes = [], [], [], []
    quiet = _NotRetracing()  # each layer gets a function of its own, traced once on purpose
    tf.get_logger().addFilter(quiet)
    for layer in layer_chain(kind, num_classes):
        with tf.device(device):
            outputs = layer(x)

        @tf.function
        def forward_backward(repeats, layer=layer, inputs=x):
            differentiable = inputs.dtype.is_floating
            with tf.device(device):
                touched = tf.constant(0.0)
                for _ in tf.range(repeats):
                    with tf.GradientTape() as tape:
                        if differentiable:
                            tape.watch(inputs)
                        result = layer(inputs, training=True)
                    sources = layer.trainable_weights + ([inputs] if differentiable else [])
                    for tensor in tape.gradient(result, sources) if sources else [result]:
                        touched += tf.cast(tf.reshape(tensor, [-1])[0], tf.float32)  # keeps the work from being pruned
            return touched

        seconds.append(_layer_seconds(forward_backward))
        names.append(layer.name)
        parameters.append(layer.count_params())
        cut_bytes.append(outputs.shape.num_elements() * outputs.dtype.size)
        x = outputs
    tf.get_logger().removeFilter(quiet)
    return {"layers": names, "parameters": parameters, "layer_seconds": seconds, "cut_bytes": cut_bytes}


def _layer_seconds(forward_backward) -> float:
    """Seconds of one pass of ``forward_backward(repeats)``: timed once, and where one pass is shorter
    than ``LAYER_TIMING_SECONDS``, the median of ``LAYER_TIMINGS`` timings with it repeated inside
    each call."""
    once = _seconds_per_call(lambda: forward_backward(tf.constant(1)), 0.0)
    if once >= LAYER_TIMING_SECONDS:
        return once
    repeats = tf.constant(max(1, min(MAX_LAYER_REPEATS, math.ceil(LAYER_CALL_SECONDS / once))))
    timings = [
        _seconds_per_call(lambda: forward_backward(repeats), LAYER_TIMING_SECONDS) / int(repeats)
        for _ in range(LAYER_TIMINGS)
    ]
    return statistics.median(timings)


def time_devices(devices: list[str]) -> list[float]:
    """Seconds each device takes for the same fixed work (``CALIBRATION_PRODUCTS`` products of
    ``CALIBRATION_SIZE``-square matrices): its speed, as the stage's replica gets it."""
    timings = []
    for device in devices:

        @tf.function
        def work(device=device):
            with tf.device(device):
                matrix = tf.random.stateless_uniform([CALIBRATION_SIZE, CALIBRATION_SIZE], seed=[0, 0])
                product = matrix
                for _ in tf.range(CALIBRATION_PRODUCTS):
                    product = tf.matmul(product, matrix) / CALIBRATION_SIZE
                return tf.reduce_sum(product)

        timings.append(_seconds_per_call(work, DEVICE_TIMING_SECONDS))
    return timings


def time_transfers(devices: list[str]) -> list[float]:
    """Seconds per byte that moving a ``TRANSFER_BYTES`` tensor from each device to the next takes
    (over gRPC between stage replicas, a copy between one replica's devices)."""
    per_byte = []
    for source, target in zip(devices, devices[1:]):
        with tf.device(source):
            tensor = tf.Variable(tf.zeros([TRANSFER_BYTES // 4]))

        @tf.function
        def move(source=source, target=target, tensor=tensor):
            with tf.device(source):
                sent = tensor.read_value()
            with tf.device(target):
                return tf.reduce_sum(sent)

        per_byte.append(_seconds_per_call(move, DEVICE_TIMING_SECONDS) / TRANSFER_BYTES)
    return per_byte


def layer_parameters(kind: str, input_shape: list[int], num_classes: int) -> list[int]:
    """Each layer's parameter count (``layer_chain``), built in a graph of its own: its variables are
    never initialised, so counting wide_mlp's 80 M parameters allocates none of them."""
    counts = []
    with tf.Graph().as_default():
        x = tf.keras.Input(shape=input_shape, dtype=tf.uint8)
        for layer in layer_chain(kind, num_classes):
            x = layer(x)
            counts.append(layer.count_params())
    return counts


def refuse_unsplittable(spec: RunSpec, dataset: DatasetRecord) -> None:
    """Before any replica starts: SpecError, in one line, where no cut by measured time could keep
    each stage within its replica's memory (``StateLimits``; that every stage can hold some of the
    weights, the spec checks without the data)."""
    cluster = spec.cluster
    if cluster.stage_split != "measured" or not cluster.stage_memory_mb:
        return
    parameters = layer_parameters(spec.model.architecture, dataset.input_shape, dataset.num_classes)
    reason = StateLimits.of(spec, parameters).unsplittable(cluster.worker.replicas)
    if reason:
        kind, workers = spec.model.architecture, cluster.worker.replicas
        raise SpecError([f"model_parallel cannot split model={kind} over workers={workers}: {reason}"])


def plan_stages(spec: RunSpec, dataset: DatasetRecord, devices: list[str]) -> tuple[StageSplitPlan, str]:
    """Where to cut the model (``hetflow.models.stage_split``), by the spec's ``stage_split``, and
    the numbers behind it: plan.json's ``stage_split``, which the pipeline recomputes; and, in a
    line, what bound the cut."""
    micro_batch = -(-spec.training.batch_size // spec.cluster.micro_batches)
    profile = profile_layers(spec.model.architecture, dataset.input_shape, dataset.num_classes, micro_batch, devices[0])
    by_parameters = split_by_parameters(profile["parameters"], len(devices))
    costs = StageCosts(profile["layer_seconds"], time_devices(devices), profile["cut_bytes"], time_transfers(devices))
    bounds, bound = chosen_split(spec, profile["parameters"], costs, by_parameters)
    plan = StageSplitPlan(
        method=spec.cluster.stage_split,
        devices=devices,
        **profile,
        stage_work_seconds=costs.stage_work_seconds,
        transfer_seconds_per_byte=costs.transfer_seconds_per_byte,
        bounds=bounds,
        stage_seconds=stage_seconds(bounds, costs),
        parameter_bounds=by_parameters,
        parameter_stage_seconds=stage_seconds(by_parameters, costs),
    )
    return plan, bound

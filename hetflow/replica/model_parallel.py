"""Model parallelism: consecutive layer groups (stages) on different devices, pipelined.

Each stage's variables and optimizer slots live on its device and its ops run there; activations
flow from stage to stage, forward then backward. That is what lets a model larger than one
replica's memory train at all, and why it is usually slower than data parallelism when the model
does fit: stages wait on each other instead of working side by side (not always: where the
all-reduce of a wide model's gradients dominates, bench/MODEL_PARALLEL.md measured the reverse).

The stages are either one replica's devices (workers=1, devices_per_worker >= 2) or, with
workers >= 2, one worker replica each: the workers only run TensorFlow servers, and the chief
connects to them (``tf.config.experimental_connect_to_cluster``) and runs one ``tf.function``
spanning them all; TensorFlow partitions it by device and moves activations and gradients between
the replicas over gRPC itself.

Pipelining (GPipe's schedule): a step splits the global batch into ``micro_batches``, runs every
micro-batch forward through the stages, then every one backward, and applies one update from the
summed gradients. Each micro-batch's loss is its summed example losses over the *global* batch, so
the sum of the micro-batches' gradients is exactly the unsplit batch's mean-loss gradient. Nothing
orders one micro-batch's forward pass after another's, so TensorFlow's executor may run stage 1 on
micro-batch k while stage 2 runs micro-batch k-1, and it does: a compute-bound step over two CPU
stage replicas went 1.51x faster in 8 micro-batches (bench/PIPELINE_OVERLAP.md). Where each
micro-batch's weight gradients dominate (a wide model at a small batch) the split step is slower
(bench/MODEL_PARALLEL.md), so ``micro_batches`` defaults to 1. Layers with batch statistics (batch
normalization) would see micro-batches, not the batch: hetflow's models have none
(``hetflow.models.architectures``).

A custom loop serves this mode: the forward and backward passes must run stage by stage under each
stage's device scope, which ``model.fit`` would not do.
"""

from __future__ import annotations

import inspect
import logging
import math
import socket
import statistics
import time
from typing import Any

import tensorflow as tf

from hetflow.data.pipeline import eval_input, train_input
from hetflow.models.architectures import build_model_parallel, layer_chain
from hetflow.models.schedule import make_optimizer, steps_per_epoch
from hetflow.models.stage_split import StageSplitPlan, split_by_parameters, split_by_time, stage_seconds
from hetflow.paths import RunPaths
from hetflow.records import DatasetRecord, PlanFile
from hetflow.replica.checkpoint import EpochCheckpoint
from hetflow.replica.loop import EpochLoop, validation_sums
from hetflow.replica.record import Trained, tensor_bytes, worker_rate
from hetflow.replica.runtime import local_devices
from hetflow.spec import RunSpec

# How long the chief waits for every stage's server to listen: replicas start together, and a
# container's name resolves only once the engine has started it.
SERVERS_UP_SECONDS = 300
# The fixed work each stage's device is timed on: chained matrix products, each one round trip.
CALIBRATION_SIZE, CALIBRATION_PRODUCTS = 256, 16
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


def micro_batch_sizes(batch: int, parts: int) -> list[int]:
    """``batch`` examples in ``parts`` micro-batches as equal as whole examples allow."""
    return [batch // parts + (1 if index < batch % parts else 0) for index in range(parts)]


def wait_for_servers(addresses: list[str], seconds: float = SERVERS_UP_SECONDS) -> None:
    """Return once every ``host:port`` accepts a connection; TimeoutError naming the first that
    does not within ``seconds``."""
    deadline = time.monotonic() + seconds
    for address in addresses:
        host, port = address.rsplit(":", 1)
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=5).close()
                break
            except OSError as refused:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stage server {address} did not listen within {seconds:.0f} s: {refused}")
                time.sleep(0.5)


def connect_stage_workers() -> list[str]:
    """Connect this chief to the run's worker replicas; returns each worker's device, in order."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster = resolver.cluster_spec()
    workers = cluster.job_tasks("worker")
    wait_for_servers(workers)
    tf.config.experimental_connect_to_cluster(cluster, job_name="chief", task_index=0, protocol="grpc")
    return [f"/job:worker/replica:0/task:{index}/device:CPU:0" for index in range(len(workers))]


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
    """Each layer of the model (``layer_chain``): its name, parameters, and the seconds its forward and
    backward pass of one micro-batch take on ``device``: a stage's, with the threads its replica has
    (timed on the chief's own threads, the convnet's last stage was given 0.34 of the cost where a
    one-thread stage spent 0.46). Built and timed one layer at a time, so no device ever holds the
    whole model that the stages share."""
    with tf.device(device):
        x = tf.zeros([micro_batch, *input_shape], tf.uint8)
    names, parameters, seconds = [], [], []
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
        x = outputs
    tf.get_logger().removeFilter(quiet)
    return {"layers": names, "parameters": parameters, "layer_seconds": seconds}


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
                for _ in range(CALIBRATION_PRODUCTS):
                    product = tf.matmul(product, matrix) / CALIBRATION_SIZE
                return tf.reduce_sum(product)

        timings.append(_seconds_per_call(work, DEVICE_TIMING_SECONDS))
    return timings


def plan_stages(spec: RunSpec, dataset: DatasetRecord, devices: list[str]) -> StageSplitPlan:
    """Where to cut the model (``hetflow.models.stage_split``), by the spec's ``stage_split``, and
    the numbers behind it: plan.json's ``stage_split``, which the pipeline recomputes."""
    micro_batch = -(-spec.training.batch_size // spec.cluster.micro_batches)
    profile = profile_layers(spec.model.architecture, dataset.input_shape, dataset.num_classes, micro_batch, devices[0])
    by_parameters = split_by_parameters(profile["parameters"], len(devices))
    work = time_devices(devices)
    by_time = split_by_time(profile["layer_seconds"], work)
    bounds = by_time if spec.cluster.stage_split == "measured" else by_parameters
    return StageSplitPlan(
        method=spec.cluster.stage_split,
        devices=devices,
        **profile,
        stage_work_seconds=work,
        bounds=bounds,
        stage_seconds=stage_seconds(bounds, profile["layer_seconds"], work),
        parameter_bounds=by_parameters,
        parameter_stage_seconds=stage_seconds(by_parameters, profile["layer_seconds"], work),
    )


def update_on_each_stage(optimizer) -> None:
    """Make ``optimizer`` create each slot and compute each update on its variable's device.

    Keras places the variables themselves there (slots are colocated with theirs), but computes a
    slot's initial zeros and an update's arithmetic (Adam's moments) on the default device, which
    is the chief's: in an experiment with 50 M parameters on two stages the chief's peak grew by
    1.0 GB, and every step moved each gradient and slot to the chief and back. (Keras has no public
    hook for where an update runs; these are the two methods its ``apply_gradients`` and ``build``
    call per variable.)"""
    for name, argument in (
        ("add_variable_from_reference", "model_variable"),
        ("_update_step", "variable"),
        ("_update_step_xla", "variable"),
    ):
        method = getattr(optimizer, name, None)
        if method is None:
            continue

        def on_variables_device(*args, method=method, argument=argument, **kwargs):
            variable = inspect.signature(method).bind(*args, **kwargs).arguments[argument]
            with tf.device(variable.device):
                return method(*args, **kwargs)

        setattr(optimizer, name, on_variables_device)


def pipelined_step(groups, optimizer, global_batch: int, micro_batches: int):
    """One training step over the stages ``groups`` [(device, layers)], in ``micro_batches``;
    returns the batch's mean loss and its correctly classified examples."""
    sizes = micro_batch_sizes(global_batch, micro_batches)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    stage_variables = [[w for layer in layers for w in layer.trainable_weights] for _, layers in groups]
    last = len(groups) - 1

    @tf.function
    def step(images, labels):
        image_parts, label_parts = tf.split(images, sizes), tf.split(labels, sizes)
        # Forward, every micro-batch: each stage under its own tape, so its backward runs on its device.
        passes, loss, correct = [], 0.0, 0.0
        for micro_images, micro_labels in zip(image_parts, label_parts):
            tapes, inputs, x = [], [], micro_images
            for index, (device, layers) in enumerate(groups):
                with tf.device(device), tf.GradientTape() as tape:
                    if index:
                        tape.watch(x)
                    inputs.append(x)
                    for layer in layers:
                        x = layer(x, training=True)
                    if index == last:
                        micro_loss = tf.reduce_sum(loss_fn(micro_labels, x)) / global_batch
                        hits = tf.reduce_sum(tf.cast(tf.argmax(x, axis=1) == micro_labels, tf.float32))
                tapes.append(tape)
            passes.append((tapes, inputs, micro_loss))
            loss += micro_loss
            correct += hits
        # Backward, every micro-batch, last stage first; gradients summed on each stage's device.
        # A stage's next micro-batch waits for the previous one's sum, so it holds two gradients'
        # worth at most, not one per micro-batch (its device runs them one after another anyway).
        summed = [None] * len(groups)
        for tapes, inputs, micro_loss in passes:
            target, upstream = micro_loss, None
            for index in reversed(range(len(groups))):
                with tf.device(groups[index][0]), tf.control_dependencies(summed[index]):
                    sources = stage_variables[index] + ([inputs[index]] if index else [])
                    gradients = tapes[index].gradient(target, sources, output_gradients=upstream)
                    weights = gradients[: len(stage_variables[index])]
                    summed[index] = (
                        weights if summed[index] is None else [a + b for a, b in zip(summed[index], weights)]
                    )
                    if index:
                        target, upstream = inputs[index], gradients[-1]
        pairs = [pair for index in range(len(groups)) for pair in zip(summed[index], stage_variables[index])]
        optimizer.apply_gradients(pairs)
        return loss, correct

    return step


def on_device(placed: str, device: str) -> bool:
    """Whether a variable placed at ``placed`` (TensorFlow's full name) is on ``device`` (as short
    as ``/device:CPU:1`` in one process)."""
    wanted, actual = tf.DeviceSpec.from_string(device), tf.DeviceSpec.from_string(placed)
    fields = ("job", "replica", "task", "device_type", "device_index")
    return all(getattr(wanted, field) in (None, getattr(actual, field)) for field in fields)


def stage_record(groups, optimizer) -> list[dict[str, Any]]:
    """Per stage: its device, its layers, and the bytes of its variables and optimizer slots, read
    back from where TensorFlow placed them; RuntimeError if a layer's variable is elsewhere."""
    slots = [variable for variable in optimizer.variables() if variable.shape.rank]  # not the step counter
    stages = []
    for device, layers in groups:
        variables = [w for layer in layers for w in layer.weights]
        misplaced = sorted({v.device for v in variables if not on_device(v.device, device)})
        if misplaced:
            raise RuntimeError(f"variables of the stage on {device} were placed on {', '.join(misplaced)}")
        stages.append(
            {
                "device": device,
                "layers": [layer.name for layer in layers],
                "variable_bytes": tensor_bytes(variables),
                "slot_bytes": tensor_bytes(slot for slot in slots if on_device(slot.device, device)),
            }
        )
    return stages


def train(spec: RunSpec, dataset: DatasetRecord, paths: RunPaths, task: dict[str, Any]) -> Trained:
    across_workers = spec.cluster.chief_coordinates
    devices = connect_stage_workers() if across_workers else local_devices(spec.cluster.worker_device(0).count)
    plan = plan_stages(spec, dataset, devices)
    PlanFile(stage_split=plan.model_dump()).write(paths.plan)
    model, groups = build_model_parallel(
        spec.model.architecture,
        dataset.input_shape,
        dataset.num_classes,
        spec.training.seed,
        devices,
        plan.bounds,
    )
    predicted = dict(zip(devices, plan.stage_seconds))
    for device, layers in groups:
        names = ", ".join(layer.name for layer in layers)
        print(f"{device}: {names} ({1000 * predicted[device]:.1f} ms a micro-batch, predicted)", flush=True)
    slowest = max(plan.stage_seconds)
    print(
        f"layer groups split by {plan.method}: slowest stage {1000 * slowest:.1f} ms a micro-batch, predicted; "
        f"by parameters it would be {1000 * max(plan.parameter_stage_seconds):.1f} ms",
        flush=True,
    )
    loop = EpochLoop(spec, steps_per_epoch(spec, dataset), paths.progress)
    optimizer = make_optimizer(spec, loop.schedule)
    update_on_each_stage(optimizer)
    batch, micro_batches = spec.training.batch_size, spec.cluster.micro_batches
    train_step = pipelined_step(groups, optimizer, batch, micro_batches)

    def forward(images):
        x = images
        for device, layers in groups:
            with tf.device(device):
                for layer in layers:
                    x = layer(x, training=False)
        return x

    predict = tf.function(forward)
    batches = iter(train_input(dataset, per_worker_batch=batch, shuffle=spec.training.shuffle, seed=spec.training.seed))
    checkpoint = EpochCheckpoint(spec, paths, True, model, optimizer)
    validation = eval_input(dataset, "validation")
    loop.run(
        loop.one_step_at_a_time(lambda: train_step(*next(batches))),
        lambda: validation_sums(predict, validation),
        checkpoint,
    )
    stages = stage_record(groups, optimizer)
    placement = [
        {"layer": layer.name, "device": device, "variables": sorted({v.device for v in layer.weights})}
        for device, layers in groups
        for layer in layers
    ]
    rate = worker_rate(batch, loop.clock.epochs_done * loop.steps, loop.train_seconds)
    if across_workers:  # every stage takes part in every step
        per_worker = {
            f"worker-{index}": {**rate, **{key: stage[key] for key in ("layers", "variable_bytes", "slot_bytes")}}
            for index, stage in enumerate(stages)
        }
    else:
        per_worker = {"worker-0": rate}
    fields = {
        "replicas_in_sync": 1,
        "per_worker": per_worker,
        "layer_placement": placement,
        "micro_batches": micro_batches,
    }
    return Trained(loop, model, fields)

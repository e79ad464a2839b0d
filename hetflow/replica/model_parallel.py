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
micro-batch's weight gradients dominate (a wide model at a small batch: three of wide_mlp's layers
took 3.9x as long for 64 examples in 8 micro-batches as in one) the split step is slower, so
``micro_batches`` defaults to 1. Layers with batch statistics (batch
normalization) would see micro-batches, not the batch: hetflow's models have none
(``hetflow.models.architectures``).

A custom loop serves this mode: the forward and backward passes must run stage by stage under each
stage's device scope, which ``model.fit`` would not do.
"""

from __future__ import annotations

import inspect
import socket
import time
from typing import Any

import tensorflow as tf

from hetflow.data.pipeline import eval_input, train_input
from hetflow.models.architectures import build_model_parallel
from hetflow.models.schedule import make_optimizer, steps_per_epoch
from hetflow.paths import RunPaths
from hetflow.records import DatasetRecord, PlanFile
from hetflow.replica.checkpoint import EpochCheckpoint
from hetflow.replica.loop import EpochLoop, validation_sums
from hetflow.replica.record import Trained, tensor_bytes, worker_rate
from hetflow.replica.runtime import local_devices
from hetflow.replica.stage_profile import plan_stages
from hetflow.spec import RunSpec

# How long the chief waits for every stage's server to listen: replicas start together, and a
# container's name resolves only once the engine has started it.
SERVERS_UP_SECONDS = 300


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
    plan, bound = plan_stages(spec, dataset, devices)
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
        f"by parameters it would be {1000 * max(plan.parameter_stage_seconds):.1f} ms; bound by {bound}",
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
    training = spec.training
    batches = iter(
        train_input(
            dataset,
            per_worker_batch=batch,
            shuffle=training.shuffle,
            seed=training.seed,
            shuffle_buffer=training.shuffle_buffer,
            cache_budget_mb=training.cache_budget_mb,
        )
    )
    checkpoint = EpochCheckpoint(spec, paths, True, model, optimizer)
    validation = eval_input(dataset, "validation", cache_budget_mb=training.cache_budget_mb)
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

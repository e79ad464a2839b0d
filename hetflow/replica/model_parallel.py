"""Model parallelism inside one replica: consecutive layer groups on different devices.

Each group's variables live on its device and its ops run there; activations flow from device to
device, forward then backward. That is what lets a model larger than one device's memory train at
all, and why it is slower than data parallelism when the model does fit: the devices wait on each
other instead of working side by side. Parameter-server sharding is the other way to spread a
model's *variables* over machines (``parameter_server`` with several ps); the compute there stays
whole on each worker.

A custom loop serves this mode: the forward pass must be run group by group under each group's
device scope, which ``model.fit`` would not do.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hetflow.data.pipeline import eval_input, train_input
from hetflow.models.architectures import build_model_parallel
from hetflow.models.schedule import make_optimizer, steps_per_epoch
from hetflow.paths import RunPaths
from hetflow.replica.checkpoint import EpochCheckpoint
from hetflow.replica.loop import EpochLoop, validation_sums
from hetflow.replica.record import Trained, worker_rate
from hetflow.replica.runtime import local_devices
from hetflow.spec import RunSpec


def train(spec: RunSpec, dataset: dict[str, Any], paths: RunPaths, task: dict[str, Any]) -> Trained:
    devices = local_devices(spec.cluster.worker_device(0).count)
    model, groups = build_model_parallel(
        spec.model.architecture, dataset["input_shape"], dataset["num_classes"], spec.training.seed, devices
    )
    for device, layers in groups:
        print(f"{device}: {', '.join(layer.name for layer in layers)}", flush=True)
    loop = EpochLoop(spec, steps_per_epoch(spec, dataset))
    optimizer = make_optimizer(spec, loop.schedule)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def forward(images, training: bool):
        x = images
        for device, layers in groups:
            with tf.device(device):
                for layer in layers:
                    x = layer(x, training=training)
        return x

    @tf.function
    def train_step(images, labels):
        with tf.GradientTape() as tape:
            logits = forward(images, training=True)
            loss = loss_fn(labels, logits)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        correct = tf.reduce_sum(tf.cast(tf.argmax(logits, axis=1) == labels, tf.float32))
        return loss, correct

    predict = tf.function(lambda images: forward(images, training=False))
    batches = iter(
        train_input(
            dataset, per_worker_batch=spec.training.batch_size, shuffle=spec.training.shuffle, seed=spec.training.seed
        )
    )
    checkpoint = EpochCheckpoint(spec, paths, True, model, optimizer)
    validation = eval_input(dataset, "validation")
    loop.run(
        loop.one_step_at_a_time(lambda: train_step(*next(batches))),
        lambda: validation_sums(predict, validation),
        checkpoint,
    )
    placement = [
        {"layer": layer.name, "device": device, "variables": sorted({v.device for v in layer.weights})}
        for device, layers in groups
        for layer in layers
    ]
    worker = worker_rate(spec.training.batch_size, loop.clock.epochs_done * loop.steps, loop.train_seconds)
    return Trained(
        loop, model, {"replicas_in_sync": 1, "per_worker": {"worker-0": worker}, "layer_placement": placement}
    )

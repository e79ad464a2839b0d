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

import time
from typing import Any

import tensorflow as tf

from tasks.data.pipeline import eval_input, train_input
from tasks.models import build_model_parallel
from tasks.paths import RunPaths
from tasks.spec import RunSpec
from tasks.strategies.common import (
    EpochCheckpoint,
    TrainingClock,
    learning_rate,
    local_devices,
    make_optimizer,
    one_step_at_a_time,
    run_epochs,
    save_model,
    steps_per_epoch,
    training_record,
    validation_sums,
    worker_rate,
    write_training_record,
)


def train(spec: RunSpec, dataset: dict[str, Any], paths: RunPaths) -> None:
    devices = local_devices(spec.worker_device(0).count)
    model, groups = build_model_parallel(spec.model, dataset["input_shape"], dataset["num_classes"], spec.seed, devices)
    for device, layers in groups:
        print(f"{device}: {', '.join(layer.name for layer in layers)}", flush=True)
    steps = steps_per_epoch(spec, dataset)
    schedule, lr_per_epoch = learning_rate(spec, steps)
    optimizer = make_optimizer(spec, schedule)
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
    batches = iter(train_input(dataset, per_worker_batch=spec.batch_size, shuffle=spec.shuffle, seed=spec.seed))
    checkpoint = EpochCheckpoint(spec, paths, True, model, optimizer)
    clock = TrainingClock(spec.target_accuracy)
    started = time.perf_counter()
    validation = eval_input(dataset, "validation")
    history = run_epochs(
        spec,
        steps,
        one_step_at_a_time(lambda: train_step(*next(batches)), steps, clock),
        lambda: validation_sums(predict, validation),
        checkpoint,
        clock,
    )
    train_seconds = time.perf_counter() - started
    save_model(model, spec, dataset, paths.model)
    write_training_record(
        paths,
        training_record(
            spec,
            steps=steps,
            replicas_in_sync=1,
            history=history,
            lr_per_epoch=lr_per_epoch,
            clock=clock,
            train_seconds=train_seconds,
            per_worker={"worker-0": worker_rate(spec.batch_size, clock.epochs_done * steps, train_seconds)},
            layer_placement=[
                {"layer": layer.name, "device": device, "variables": sorted({v.device for v in layer.weights})}
                for device, layers in groups
                for layer in layers
            ],
        ),
    )

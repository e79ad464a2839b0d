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

import numpy as np
import tensorflow as tf

from tasks.data.pipeline import train_input
from tasks.models import build_model_parallel
from tasks.paths import RunPaths
from tasks.spec import RunSpec
from tasks.strategies.common import (
    EpochCheckpoint,
    TrainingClock,
    learning_rate,
    local_devices,
    make_optimizer,
    save_model,
    steps_per_epoch,
    validation_metrics,
    write_training_record,
)


def train(spec: RunSpec, dataset: dict[str, Any], paths: RunPaths) -> None:
    devices = local_devices(spec.worker_device(0).count)
    model, groups = build_model_parallel(spec.model, dataset["input_shape"], dataset["num_classes"], spec.seed, devices)
    for device, layers in groups:
        print(f"{device}: {', '.join(layer.name for layer in layers)}", flush=True)
    steps = steps_per_epoch(spec, dataset)
    schedule, lr_per_epoch = learning_rate(spec, 1, steps)
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
    first_epoch = checkpoint.restore()
    clock = TrainingClock(spec.target_accuracy)
    history: dict[str, list[float]] = {"loss": [], "accuracy": [], "val_loss": [], "val_accuracy": []}
    started = time.perf_counter()
    for epoch in range(first_epoch, spec.epochs):
        clock.on_epoch_begin(epoch)
        losses, correct = [], 0.0
        for _ in range(steps):
            loss, hits = train_step(*next(batches))
            clock.first_step_done()
            losses.append(float(loss))
            correct += float(hits)
        val_loss, val_accuracy = validation_metrics(predict, dataset)
        clock.on_epoch_end(epoch, {"val_accuracy": val_accuracy})
        for name, value in zip(history, (np.mean(losses), correct / (steps * spec.batch_size), val_loss, val_accuracy)):
            history[name].append(float(value))
        print(
            f"Epoch {epoch + 1}/{spec.epochs} - {clock.epoch_seconds[-1]:.1f}s - loss: {history['loss'][-1]:.4f} - "
            f"accuracy: {history['accuracy'][-1]:.4f} - val_loss: {val_loss:.4f} - val_accuracy: {val_accuracy:.4f}",
            flush=True,
        )
        checkpoint.epoch_done(epoch + 1)
        if clock.reached:
            break
    train_seconds = time.perf_counter() - started
    save_model(model, spec, dataset, paths.model)
    total_steps = clock.epochs_done * steps
    write_training_record(
        paths,
        {
            "strategy": spec.strategy,
            "replicas_in_sync": 1,
            "global_batch": spec.batch_size,
            "per_replica_batch": spec.batch_size,
            "steps_per_epoch": steps,
            "epochs": spec.epochs,
            "history": history,
            "learning_rate_per_epoch": lr_per_epoch,
            "train_seconds": train_seconds,
            **clock.record(),
            "examples_per_second": spec.batch_size * total_steps / train_seconds,
            "per_worker": {
                "worker-0": {
                    "steps": total_steps,
                    "examples_per_second": spec.batch_size * total_steps / train_seconds,
                    "step_seconds": train_seconds / total_steps,
                }
            },
            "layer_placement": [
                {"layer": layer.name, "device": device, "variables": sorted({v.device for v in layer.weights})}
                for device, layers in groups
                for layer in layers
            ],
        },
    )

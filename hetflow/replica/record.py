"""The end of a replica's training, the same for every strategy: the final weights written and, by
the chief, training.json, the run's record of how training went."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from hetflow.data.pipeline import training_input, validation_input
from hetflow.models.schedule import learning_rate_plan
from hetflow.paths import RunPaths, write_record
from hetflow.records import DatasetRecord
from hetflow.replica.loop import EpochLoop
from hetflow.replica.weights import save_model
from hetflow.spec import RunSpec


def tensor_bytes(tensors) -> int:
    """What ``tensors`` (or variables) hold, in bytes: what a step moves of them."""
    return sum(tensor.shape.num_elements() * tensor.dtype.size for tensor in tensors)


def worker_rate(batch: int, steps: int, seconds: float) -> dict[str, float]:
    """One worker's part: the steps it ran, its examples/s and its time per step."""
    if not steps:  # a retry that resumed after the last epoch
        return {"steps": 0, "examples_per_second": 0.0, "step_seconds": None}
    return {"steps": steps, "examples_per_second": batch * steps / seconds, "step_seconds": seconds / steps}


def training_record(
    spec: RunSpec,
    loop: EpochLoop,
    *,
    replicas_in_sync: int,
    per_worker: dict[str, dict[str, float]],
    per_replica_batch: int | list[int] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """training.json's content common to every strategy, made right after the final weights are
    written. ``examples_per_second`` is measured over the time in epochs (validation included);
    ``whole_job_examples_per_second`` over the time from the replica's launch to
    its final weights, with ``whole_job_breakdown`` saying where that time went;
    ``per_replica_batch`` defaults to equal shares of the global batch (balanced sync gives each
    worker's)."""
    clock = loop.clock
    seconds = sum(clock.epoch_seconds) or loop.train_seconds  # a retry with no epoch left trained 0 examples
    examples = spec.training.batch_size * clock.epochs_done * loop.steps
    return {
        "strategy": spec.cluster.strategy,
        "replicas_in_sync": replicas_in_sync,
        "global_batch": spec.training.batch_size,
        "per_replica_batch": spec.training.batch_size // replicas_in_sync
        if per_replica_batch is None
        else per_replica_batch,
        "steps_per_epoch": loop.steps,
        "epochs": spec.training.epochs,
        "history": loop.history,
        "learning_rate_schedule": learning_rate_plan(spec, loop.steps),
        "learning_rate_per_epoch": loop.lr_per_epoch,
        "train_seconds": loop.train_seconds,
        **clock.record(),
        "examples_per_second": examples / seconds,
        **clock.whole_job(examples),
        "per_worker": per_worker,
        **extra,
    }


@dataclass
class Trained:
    """What a strategy's ``train`` hands back: the loop that ran, the trained model, whether this
    replica is the chief, and the strategy's own fields of training.json (``training_record``'s
    keyword arguments: ``replicas_in_sync``, ``per_worker``, ...)."""

    loop: EpochLoop
    model: tf.keras.Model
    fields: dict[str, Any]
    chief: bool = True


def finish(spec: RunSpec, dataset: DatasetRecord, paths: RunPaths, trained: Trained) -> None:
    """Write the final weights (every replica takes part) and, on the chief, training.json."""
    save_model(trained.model, spec, dataset, paths.model, chief=trained.chief)
    if not trained.chief:
        return
    # A strategy that reads the splits otherwise says so in its own fields (sync's whole-split tensors,
    # each sync worker validating on its share).
    budget = spec.training.cache_budget_mb
    how_read = {
        "training_input": training_input(dataset, spec.training.shuffle_buffer, budget),
        "validation_input": validation_input(dataset, dataset.splits["validation"], budget),
    }
    record = training_record(spec, trained.loop, **{**how_read, **trained.fields})
    write_record(paths.training, record)
    print(
        f"trained {record['epochs']} epochs x {record['steps_per_epoch']} steps in {record['train_seconds']:.1f} s "
        f"({record['examples_per_second']:.0f} examples/s); model saved to {paths.model}",
        flush=True,
    )

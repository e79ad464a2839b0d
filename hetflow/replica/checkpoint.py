"""The checkpoint every strategy resumes from: model, optimizer and the count of finished epochs."""

from __future__ import annotations

import tempfile

import tensorflow as tf

from hetflow.paths import RunPaths
from hetflow.spec import RunSpec


class EpochCheckpoint:
    """Model, optimizer and the count of finished epochs, saved every ``checkpoint_every`` epochs
    under the run directory. ``restore``
    returns the epoch to resume from: 0 on a fresh start.

    Every replica restores from the chief's checkpoint, so after a restart all resume from the same
    epoch with the same weights. Every replica must also save (under multi_worker_mirrored saving
    may run collectives), but only the chief's copy is the run's: the others write into a scratch
    dir of their own in the run directory."""

    def __init__(self, spec: RunSpec, paths: RunPaths, chief: bool, model, optimizer, **more):
        self.every = spec.training.checkpoint_every
        self.epochs_done = tf.Variable(0, dtype=tf.int64, trainable=False, name="epochs_done")
        # Slots exist before restoring, so the optimizer state comes back too.
        optimizer.build(model.trainable_variables)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epochs_done=self.epochs_done, **more)
        self.chief_directory = paths.checkpoints / "loop"
        self.chief_directory.mkdir(parents=True, exist_ok=True)
        directory = self.chief_directory if chief else tempfile.mkdtemp(dir=paths.checkpoints, prefix=".scratch-")
        self.manager = tf.train.CheckpointManager(checkpoint, str(directory), max_to_keep=1)

    def restore(self) -> int:
        latest = tf.train.latest_checkpoint(str(self.chief_directory))
        if latest:
            self.manager.checkpoint.restore(latest)
            print(f"resumed from {latest} after epoch {int(self.epochs_done.numpy())}", flush=True)
        return int(self.epochs_done.numpy())

    def epoch_done(self, epochs_done: int) -> None:
        self.epochs_done.assign(epochs_done)
        if epochs_done % self.every == 0:
            self.manager.save()

"""What the pipeline takes of the progress file a chief writes: whole, checked epochs only; a file
that is a link or floods is read no further. The test plays the replica, writing the file."""

from __future__ import annotations

import json
import threading

import pytest

from hetflow.paths import RunPaths
from hetflow.pipeline.progress import PROGRESS_BYTES, ProgressReader, ProgressWatch
from hetflow.spec import parse_spec

SPEC = parse_spec({"epochs": 5, "strategy": "multi_worker_mirrored", "workers": 2})


def epoch_line(epoch: int, **more) -> str:
    figures = {"epoch": epoch, "time": 1.0e9, "loss": 0.5, "val_accuracy": 0.75, "learning_rate": 0.01}
    return json.dumps({**figures, **more}) + "\n"


@pytest.fixture()
def paths(tmp_path):
    paths = RunPaths(tmp_path)
    paths.output.mkdir()
    return paths


def test_whole_lines_are_read_once_and_a_line_being_written_waits(paths):
    reader = ProgressReader(paths, SPEC, ["worker-0", "worker-1"])
    assert reader.new_epochs() == []  # nothing written yet
    rates = {"worker-0": 900.0, "worker-1": 300.0}
    paths.progress.write_text(epoch_line(1, worker_examples_per_second=rates) + epoch_line(2)[:20])
    (first,) = reader.new_epochs()
    assert first.epoch == 1 and first.figures == {"loss": 0.5, "val_accuracy": 0.75, "learning_rate": 0.01}
    assert first.worker_examples_per_second == rates
    paths.progress.write_text(epoch_line(1) + epoch_line(2))
    assert [epoch.epoch for epoch in reader.new_epochs()] == [2]
    assert reader.new_epochs() == []


def test_lines_that_lie_are_dropped_and_the_rest_kept(paths, caplog):
    lies = [
        epoch_line(6),  # past the spec's epochs
        epoch_line(True),  # a bool is not an epoch
        epoch_line(3, loss=float("nan")),
        epoch_line(3, val_accuracy="0.99"),
        epoch_line(3, worker_examples_per_second={"worker-7": 1.0}),  # no such worker
        "[1, 2, 3]\n",
        "not json\n",
    ]
    paths.progress.write_text("".join(lies) + epoch_line(4, unknown_figure=1.0))
    epochs = ProgressReader(paths, SPEC, ["worker-0", "worker-1"]).new_epochs()
    assert [(epoch.epoch, epoch.figures["loss"]) for epoch in epochs] == [(4, 0.5)]
    assert "unknown_figure" not in epochs[0].figures
    warnings = [r for r in caplog.records if "dropped a progress line" in r.getMessage()]
    assert len(warnings) == 1  # one warning, however many lies


def test_a_link_is_not_followed_and_a_flood_stops_the_reading(paths, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(epoch_line(1))
    paths.progress.symlink_to(secret)
    reader = ProgressReader(paths, SPEC, ["worker-0"])
    assert reader.new_epochs() == []
    paths.progress.unlink()
    paths.progress.write_text(epoch_line(1))
    assert reader.new_epochs() == []  # refused once: read no further

    flooded = ProgressReader(paths, SPEC, ["worker-0"])
    paths.progress.write_text(epoch_line(1) * (PROGRESS_BYTES // len(epoch_line(1)) + 1))
    assert flooded.new_epochs() == []


def test_a_watcher_that_asks_to_stop_is_heard_and_one_that_fails_is_dropped(paths):
    paths.progress.write_text(epoch_line(1) + epoch_line(2))
    seen = []

    def pruner(epochs, usage):
        seen.extend(epoch.epoch for epoch in epochs)
        return "pruned at epoch 2" if 2 in seen else None

    def broken(epochs, usage):
        raise RuntimeError("tracking server gone")

    watch = ProgressWatch(
        ProgressReader(paths, SPEC, ["worker-0"]),
        lambda: {"worker-0": {"cpu_percent": 1.0}},
        [broken, pruner],
        interval=0.05,
    )
    with watch:
        pass  # the last look, on the way out, still runs
    assert seen == [1, 2] and watch.stop_reason == "pruned at epoch 2"
    assert watch.watchers == [pruner]


def test_replicas_that_end_within_an_interval_are_sampled_as_training_starts(paths):
    """A short run's replicas can be gone before the first interval is over: their usage is
    sampled as the watch starts too, not only every interval and on the way out."""
    alive, sampled = threading.Event(), threading.Event()
    alive.set()

    def sample():
        sampled.set()
        return {"worker-0": {"memory_mb": 512.0}} if alive.is_set() else {}

    usage_seen = []
    watch = ProgressWatch(
        ProgressReader(paths, SPEC, ["worker-0"]),
        sample,
        [lambda epochs, usage: usage_seen.append(usage)],
        interval=60,
    )
    with watch:
        assert sampled.wait(timeout=10), "no sample within 10 s of the start"
        alive.clear()  # the replicas ended, long before an interval
    assert {"worker-0": {"memory_mb": 512.0}} in usage_seen, usage_seen

"""The input pipelines replicas and stages iterate leave nothing to wait for when they end."""

from __future__ import annotations


def test_no_input_pipeline_runs_the_autotuning_thread(tmp_path):
    """Destroying an iterator whose autotuning thread misses its cancellation waits out that
    thread's optimization period (up to 60 s): the tail between a replica's last epoch and its
    final weights (hetflow/data/pipeline.py says how it was found)."""
    from hetflow.data.pipeline import eval_input, train_input, train_slices, training_tensors
    from hetflow.data.prepare import prepare_dataset

    dataset = prepare_dataset("uci_digits", tmp_path)
    pipelines = {
        "train_input": train_input(dataset, per_worker_batch=8, shuffle=True, seed=7),
        "train_slices": train_slices(training_tensors(dataset), start=0, end=4, global_batch=8, shuffle=True, seed=7),
        "eval_input": eval_input(dataset, "validation", examples=(0, 10)),
    }
    assert {name: pipeline.options().autotune.enabled for name, pipeline in pipelines.items()} == {
        name: False for name in pipelines
    }

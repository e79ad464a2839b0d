"""The benches' verdicts on hand-made figures: bench/straggler.py's on its aims from launch (balanced
sync <= 0.75x naive sync, auto within 10% of the best case) and the bound it states from the probes;
bench/overhead.py's floor under the fixed overhead (the Airflow floor and the later stages' imports);
bench/model_parallel.py's bound from the cores a run keeps busy; and how a bench tells whether other
work competed for the cores."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))  # the bench scripts import each other as top-level modules
import model_parallel  # noqa: E402
import model_parallel_report  # noqa: E402
import overhead  # noqa: E402
import straggler  # noqa: E402


def case(launch: float, train: float) -> dict:
    return {"launch_to_target_seconds": launch, "seconds_to_target": train, "before_first_step_seconds": launch - train}


def test_balanced_sync_and_auto_are_judged_from_launch_and_balanced_sync_is_bounded_by_its_probes():
    cases = {
        "naive_sync": case(100.0, 60.0),
        "balanced_sync": case(74.0, 33.0),  # 41 s before its first step, naive sync 40
        "async": case(80.0, 60.0),
        "auto": case(82.0, 55.0),  # 82 / 74 = 1.108: just outside 10% of balanced sync, the best
    }
    # Speeds 900 and 300: an equal-share step lasts 64/300 s, a balanced one 128/1200 s, half of it;
    # naive sync's 60 s of training become 30 s: after 41 s, 71 s of naive sync's 100 s; after 40 s,
    # 70 s; 75 s from launch leaves 45 s before the first step.
    runs = [{"case": "balanced_sync", "reached": True, "probes": [900.0, 300.0]}]
    balanced, auto, bound = straggler.aims(cases, runs)
    assert balanced == "- balanced sync from launch: **0.74x** naive sync (aim <= 0.75x: met)"
    assert auto == "- auto from launch: **1.11x** the best case, balanced_sync (aim <= 1.10x: not met)"
    assert bound.endswith(
        "at best 0.71x naive sync's 100.0 s from launch, 0.70x if measuring cost nothing; "
        "0.75x needs at most 45.0 s before the first step"
    )
    cases["balanced_sync"] = case(76.0, 50.0)
    assert straggler.aims(cases, runs)[0].endswith("**0.76x** naive sync (aim <= 0.75x: not met)")


def test_the_overhead_floor_is_airflow_alone_plus_the_imports_of_the_stages_after_training():
    run = {
        "tensorflow_import_seconds": [6.0, 4.0, 5.0],  # median 5 s
        # validate_spec's import comes before training, so it is not in the floor
        "stage_import_seconds": {"validate_spec": 0.5, "train": 0.0, "evaluate": 3.0, "compress": 1.0, "register": 0.5},
        "airflow_floor_seconds": 12.5,
    }
    verdict = overhead.floor_verdict(run)
    assert "took 12.5 s from launch to exit, 2.5× an import" in verdict
    assert "(4.5 s, below), that is 17.0 s, 3.4× an import" in verdict
    assert verdict.endswith("above the aim of 3×.")
    run["airflow_floor_seconds"] = 8.0  # 12.5 s: 2.5 imports
    assert overhead.floor_verdict(run).endswith(
        "that is 12.5 s, 2.5× an import, before any stage does its work: within the aim of 3×."
    )


def test_the_airflow_floor_is_hetflow_train_with_empty_tasks(hetflow_env):
    from airflow.dag_processing.dagbag import DagBag

    train = DagBag(dag_folder=str(REPO / "dags")).dags["hetflow_train"]
    floor = DagBag(dag_folder=str(REPO / "bench" / "airflow_floor")).dags["hetflow_floor"]

    def shape(dag):
        return {
            task.task_id: (sorted(task.upstream_task_ids), task.trigger_rule, task.is_setup, task.is_teardown)
            for task in dag.tasks
        }

    assert shape(floor) == shape(train)
    assert {key: param.schema for key, param in floor.params.items()} == {
        key: param.schema for key, param in train.params.items()
    }


def test_the_overhead_bench_imports_the_stages_in_an_order_the_dag_can_run_them(hetflow_env):
    from airflow.dag_processing.dagbag import DagBag
    from overhead_yardsticks import TASKS_IN_ORDER

    train = DagBag(dag_folder=str(REPO / "dags")).dags["hetflow_train"]
    assert sorted(TASKS_IN_ORDER) == sorted(train.task_ids)
    for position, task_id in enumerate(TASKS_IN_ORDER):
        assert train.get_task(task_id).upstream_task_ids <= set(TASKS_IN_ORDER[:position]), task_id


def test_other_work_is_read_from_the_cores_busy_before_a_run():
    from report import busy_cores, other_work_line

    spinning = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert busy_cores(1.0) >= 0.8  # one core spinning, whatever else the machine does
    finally:
        spinning.kill()
        spinning.wait()
    assert other_work_line([0.01, 0.02], "before each run") == (
        "- cores busy in the 2 s before each run, the bench waiting: 0.01, 0.02"
    )
    assert other_work_line([0.01, 0.3], "before each run").endswith(
        "0.01, 0.30 (other work was competing for the cores)"
    )


def test_the_cores_a_run_keeps_busy_are_its_replicas_cpu_seconds_over_the_last_epoch_and_bound_pipelining():
    epochs = [
        {"epochs": 1, "at": 10.0, "cpu_seconds": {"chief-0": 5.0, "worker-0": 3.0}},
        # worker-1 had not been read at epoch 1: all its CPU time counts
        {"epochs": 2, "at": 14.0, "cpu_seconds": {"chief-0": 6.0, "worker-0": 8.0, "worker-1": 4.0}},
    ]
    assert model_parallel.busy_cores_over_last_epoch(epochs) == 2.5  # (1 + 5 + 4) s over 4 s
    assert model_parallel.busy_cores_over_last_epoch(epochs[:1]) is None
    none_found = [{**epoch, "cpu_seconds": {}} for epoch in epochs]  # replicas on another machine's nodes
    assert model_parallel.busy_cores_over_last_epoch(none_found) is None
    (line,) = model_parallel_report.core_bound_lines(1.6, 2)
    assert line.startswith("- unpipelined, the replicas already keep 1.60 of the machine's 2 cores busy")
    assert line.endswith("can be at most 1.25x faster, whatever the split and the number of micro-batches")
    assert model_parallel_report.core_bound_lines(None, 2) == []

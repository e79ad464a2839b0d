"""Fixed pipeline overhead: a real run says where its time went (per stage: MLflow I/O and work,
timed without patching the interpreter; the DAG's wall time, the training's and the rest), and the
models it logs carry the requirements hetflow gives MLflow rather than ones MLflow infers."""

from __future__ import annotations

import builtins
import importlib
import json
import re
import threading
import time
from importlib.metadata import version
from pathlib import Path

import pytest
from conftest import REPO

from hetflow.paths import RunPaths
from hetflow.pipeline.timing import PARTS

# The interpreter's own, taken before any hetflow module is imported.
_ORIGINAL_IMPORT, _ORIGINAL_IMPORT_MODULE = builtins.__import__, importlib.import_module


def test_a_stage_clock_counts_each_part_once_and_patches_nothing():
    from hetflow.pipeline import timing

    def marked_elsewhere():
        with timing.part("mlflow_io"):  # another thread: no stage's clock runs there
            time.sleep(0.3)

    with timing.stage_clock() as clock:
        assert builtins.__import__ is _ORIGINAL_IMPORT and importlib.import_module is _ORIGINAL_IMPORT_MODULE
        with timing.part("mlflow_io"):
            time.sleep(0.2)
            with timing.part("mlflow_io"):  # a TimedClient call inside a block marked already
                time.sleep(0.2)
        other = threading.Thread(target=marked_elsewhere)
        other.start()
        other.join()  # waited for on this thread: work
        recorded = clock.record()
    # Bounds below what double counting would give: MLflow I/O 0.6 s (nested) or 0.7 s (the other thread).
    assert 0.4 <= recorded["mlflow_io"] < 0.55
    assert 0.3 <= recorded["work"] < 0.45
    assert sum(recorded[part] for part in PARTS) == pytest.approx(recorded["wall"], abs=1e-6)
    assert timing.current() is None


def _task_seconds(stdout: str) -> dict[str, float]:
    """Each DAG task's time as `hetflow run`'s live view printed it (Airflow's task boundaries)."""
    return {task: float(seconds) for task, seconds in re.findall(r"^  (\w+) done in ([0-9.]+) s$", stdout, re.M)}


@pytest.mark.slow
def test_every_stage_says_where_its_time_went(e2e_first_run):
    done, summary = e2e_first_run
    timings = summary["timings"]
    stages = timings["stages"]
    assert list(stages) == [
        "validate_spec",
        "prepare_data",
        "provision_cluster",
        "train",
        "evaluate",
        "compress",
        "export",
        "register",
    ]
    tasks = _task_seconds(done.stdout)
    compared_with_receipts = 0
    for stage, timing in stages.items():
        assert all(timing[part] >= 0 for part in PARTS), (stage, timing)
        assert sum(timing[part] for part in PARTS) == pytest.approx(timing["wall"], abs=1e-6), (stage, timing)
        # Airflow's own clock around the task holds the stage's (the live view prints tenths).
        assert timing["wall"] <= tasks[stage] + 0.05, (stage, timing, tasks[stage])
        receipt = json.loads((Path(summary["run_dir"]) / "attempts" / f"{stage}.json").read_text())
        if receipt["try_number"] is not None:  # test_e2e_run re-runs register on this run outside Airflow
            assert receipt["timing"]["wall"] == timing["wall"]
            compared_with_receipts += 1
    assert compared_with_receipts >= len(stages) - 1
    # The parts name real costs: validate_spec opens the run's MLflow run, prepare_data asks MLflow
    # about the spec, register talks to MLflow; train's live logging runs on its watcher thread, beside
    # the supervision, so it is none of train's own MLflow time.
    assert stages["validate_spec"]["mlflow_io"] > 0
    assert stages["prepare_data"]["mlflow_io"] > 0
    assert stages["register"]["mlflow_io"] > 0.1
    assert stages["train"]["mlflow_io"] == 0


@pytest.mark.slow
def test_the_dag_time_is_the_stages_airflow_and_the_training_beside_them(e2e_first_run):
    _, summary = e2e_first_run
    timings = summary["timings"]
    training = json.loads(RunPaths(Path(summary["run_dir"])).training.read_text())
    assert timings["training_seconds"] == training["whole_job_seconds"]
    assert timings["fixed_overhead_seconds"] == pytest.approx(timings["dag_seconds"] - training["whole_job_seconds"])
    in_stages = sum(timing["wall"] for timing in timings["stages"].values())
    assert timings["airflow_seconds"] == pytest.approx(timings["dag_seconds"] - in_stages)
    assert 0 <= timings["airflow_before_first_stage_seconds"] <= timings["airflow_seconds"]
    # The replicas' whole job starts in provision_cluster and ends within train.
    stages = timings["stages"]
    assert (
        training["whole_job_seconds"]
        <= stages["provision_cluster"]["wall"] + stages["train"]["wall"] + (timings["airflow_seconds"])
    )


def _lock_pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        name, _, pinned = line.partition("==")
        if pinned:
            pins[re.sub(r"[-_.]+", "-", name.lower())] = pinned.strip()
    return pins


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "packages"),
    [("float", ("mlflow", "tensorflow", "numpy")), ("tflite", ("mlflow", "ai-edge-litert", "numpy"))],
)
def test_logged_models_carry_the_requirements_hetflow_gives(e2e_first_run, hetflow_env, tmp_path, kind, packages):
    """Given, each pinned to the version installed here (and in requirements.lock); never inferred by
    MLflow importing the model, which would also take what the model does not need (Keras)."""
    import mlflow

    _, summary = e2e_first_run
    model = summary["registry"]["models"][("float", "tflite").index(kind)]
    copy = mlflow.artifacts.download_artifacts(
        model["model_uri"], dst_path=str(tmp_path), tracking_uri=hetflow_env["MLFLOW_TRACKING_URI"]
    )
    requirements = (Path(copy) / "requirements.txt").read_text().split()
    assert sorted(requirements) == sorted(f"{package}=={version(package)}" for package in packages)
    pins = _lock_pins()
    assert all(f"{package}=={pins[package]}" in requirements for package in packages)


def test_the_command_leaves_its_objects_to_the_exit_uncollected(hetflow_env):
    """The interpreter's last collection would walk every object TensorFlow and Airflow made, seconds
    between the command's work and its exit; frozen objects are skipped."""
    import gc

    from hetflow.cli.main import main

    gc.unfreeze()
    try:
        assert main(["validate", "--set", "epochs=2"]) == 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # this test process goes on collecting

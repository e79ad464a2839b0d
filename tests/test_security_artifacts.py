"""No artifact runs code: a replica writes weights only, and every stage rebuilds the model from the
run's spec and reads only weights, refusing anything else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

import hetflow  # noqa: F401  (sets TF_USE_LEGACY_KERAS before anything here imports TensorFlow)
from hetflow.records import DatasetRecord

DIGITS = DatasetRecord.model_construct(input_shape=[8, 8, 1], num_classes=10)  # what building the model reads


def hostile_model(marker: Path):
    """The digits MLP behind a Lambda layer whose function writes ``marker`` whenever it is called,
    as it is when tf_keras rebuilds the model from a file."""
    import tensorflow as tf

    from hetflow.models.architectures import build_model

    def payload(x, marker=str(marker)):
        import pathlib

        pathlib.Path(marker).write_text("code from the artifact ran")
        return x

    mlp = build_model("mlp", DIGITS.input_shape, DIGITS.num_classes, seed=1)
    pixels = tf.keras.Input(shape=DIGITS.input_shape, dtype=tf.uint8)
    model = tf.keras.Model(pixels, mlp(tf.keras.layers.Lambda(payload)(pixels)))
    marker.unlink()  # building it called the payload once
    return model


def hostile_hdf5(directory: Path, marker: Path) -> Path:
    """A tf_keras HDF5 model file (the legacy path, where safe_mode does not apply) with the payload."""
    path = directory / "hostile.h5"
    hostile_model(marker).save(path, save_format="h5")
    return path


def trained_weights(directory: Path) -> tuple[Path, list[np.ndarray]]:
    """A weights file as a chief writes it, with weights unlike a fresh model's, and those weights."""
    from hetflow.models.architectures import build_model
    from hetflow.replica.weights import save_model
    from hetflow.spec import RunSpec

    model = build_model("mlp", DIGITS.input_shape, DIGITS.num_classes, seed=3)
    model.set_weights([w * 2 + 0.5 for w in model.get_weights()])
    path = directory / "model.weights.h5"
    save_model(model, RunSpec.from_values({"model": "mlp", "seed": 1}), DIGITS, path)
    return path, model.get_weights()


def fresh_mlp():
    from hetflow.models.architectures import build_model

    return build_model("mlp", DIGITS.input_shape, DIGITS.num_classes, seed=1)


def test_the_chief_writes_weights_that_read_back_into_the_rebuilt_model_and_nothing_more(tmp_path):
    from hetflow.models.architectures import read_weights
    from hetflow.replica.weights import save_model
    from hetflow.spec import RunSpec

    path, weights = trained_weights(tmp_path)
    with h5py.File(path, "r") as file:
        assert "model_config" not in file.attrs and "layers" in file  # arrays by layer, no architecture
    read = read_weights(fresh_mlp(), path).get_weights()
    assert len(read) == len(weights) and all(np.array_equal(a, b) for a, b in zip(read, weights))
    # A non-chief takes part in saving but leaves nothing behind, beside the chief's copy or in place of it.
    other = tmp_path / "other"
    other.mkdir()
    save_model(
        fresh_mlp(), RunSpec.from_values({"model": "mlp", "seed": 1}), DIGITS, other / "model.weights.h5", chief=False
    )
    assert list(other.iterdir()) == []


def _external_array(tmp_path: Path) -> Path:
    """The right arrays, but the logits bias is read from another file on the machine."""
    path, _ = trained_weights(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(np.arange(10, dtype="<f4").tobytes())
    with h5py.File(path, "a") as file:
        name = "layers/dense_1/vars/1"
        del file[name]
        file.create_dataset(name, shape=(10,), dtype="<f4", external=[(str(secret), 0, 40)])
    return path


def _other_architecture(tmp_path: Path) -> Path:
    from hetflow.models.architectures import build_model

    path = tmp_path / "model.weights.h5"
    build_model("cnn", DIGITS.input_shape, DIGITS.num_classes, seed=1).save_weights(path)
    return path


def _truncated(tmp_path: Path) -> Path:
    path, _ = trained_weights(tmp_path)
    path.write_bytes(path.read_bytes()[:-1000])
    return path


def _keras_zip(tmp_path: Path) -> Path:
    path = tmp_path / "model.weights.h5"
    fresh_mlp().save(tmp_path / "whole.keras")
    shutil.copy(tmp_path / "whole.keras", path)
    return path


def _symlink(tmp_path: Path) -> Path:
    target, _ = trained_weights(tmp_path)
    path = tmp_path / "link" / target.name
    path.parent.mkdir()
    path.symlink_to(target)
    return path


def _empty(tmp_path: Path) -> Path:
    path = tmp_path / "model.weights.h5"
    path.write_bytes(b"")
    return path


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "model.weights.h5"
    os.mkfifo(path)  # a reader that opened it would wait for a writer that never comes
    return path


def _directory(tmp_path: Path) -> Path:
    path = tmp_path / "model.weights.h5"
    path.mkdir()
    return path


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_external_array, "array layers/dense_1/vars/1 reads its data from another file"),
        (_other_architecture, "4 unexpected array(s), e.g. layers/conv2d/vars/0"),
        (_truncated, "truncated file"),
        (_keras_zip, "not an HDF5 weights file"),
        (_symlink, "a symbolic link"),
        (_empty, "not an HDF5 weights file"),
        (_fifo, "not a regular file"),
        (_directory, "not a regular file"),
    ],
)
def test_anything_but_this_architectures_weights_is_refused_in_one_line_naming_the_file(tmp_path, make, reason):
    from hetflow.models.architectures import WeightsError, read_weights

    path = make(tmp_path)
    with pytest.raises(WeightsError) as refused:
        read_weights(fresh_mlp(), path)
    message = str(refused.value)
    assert message.startswith(f"refusing {path} as the weights of the mlp model: ") and reason in message
    assert "\n" not in message


def test_a_hostile_model_file_is_refused_and_its_code_never_runs(tmp_path):
    from hetflow.models.architectures import WeightsError, read_weights

    marker = tmp_path / "marker"
    hostile = hostile_hdf5(tmp_path, marker)
    for name in ("model.weights.h5", "model.keras"):
        shutil.copy(hostile, tmp_path / name)
        with pytest.raises(WeightsError, match=f"^refusing {tmp_path / name} as the weights of the mlp model"):
            read_weights(fresh_mlp(), tmp_path / name)
    assert not marker.exists()


# A replica's process, still running while the pipeline reads its weights: it renames the good file
# and the hostile one in at the weights' name, in turn, as fast as it can.
_SWAPPER = textwrap.dedent(
    """
    import os, sys
    good, hostile, target = sys.argv[1:]
    staging = target + ".next"
    while True:
        for source in (good, hostile):
            os.link(source, staging)
            os.replace(staging, target)
    """
)


def test_the_weights_checked_are_the_weights_loaded_while_their_writer_swaps_files_in(tmp_path):
    """The pipeline checks the file, then loads it: a writer who renames a hostile file in between
    must not get it loaded. Here the hostile file has the right layout, but its logits bias is read
    from another file on this machine, which the pipeline can read and the writer cannot (a secret
    would leave in the registered model)."""
    from hetflow.models.architectures import WeightsError, read_weights

    secret = np.arange(10, dtype="<f4")
    good, weights = trained_weights(tmp_path)
    (tmp_path / "hostile").mkdir()
    hostile = _external_array(tmp_path / "hostile")
    target = tmp_path / "run" / "model.weights.h5"
    target.parent.mkdir()
    shutil.copy(good, target)
    swapper = subprocess.Popen([sys.executable, "-c", _SWAPPER, str(good), str(hostile), str(target)])
    outcomes = {"refused": 0, "trained": 0, "secret": 0, "other": 0}
    try:
        for _ in range(60):
            try:
                read = read_weights(fresh_mlp(), target).get_weights()
            except WeightsError as refused:
                assert "reads its data from another file" in str(refused)
                outcomes["refused"] += 1
                continue
            if np.array_equal(read[-1], secret):
                outcomes["secret"] += 1
            elif all(np.array_equal(a, b) for a, b in zip(read, weights)):
                outcomes["trained"] += 1
            else:
                outcomes["other"] += 1
    finally:
        swapper.kill()
        swapper.wait()
    assert outcomes["secret"] == outcomes["other"] == 0, outcomes
    assert outcomes["refused"] and outcomes["trained"], outcomes  # the swaps did reach the reads


@pytest.fixture(scope="module")
def pipeline_run(hetflow_env):
    """A run trained by a real replica and taken through evaluate, compress and export; no SavedModel
    is exported, so that register rebuilds the model from the weights too."""
    from hetflow.tasks.compress import compress
    from hetflow.tasks.evaluate import evaluate
    from hetflow.tasks.export import export
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.provision_cluster import provision_cluster
    from hetflow.tasks.teardown_cluster import teardown_cluster
    from hetflow.tasks.train import train
    from hetflow.tasks.validate_spec import validate_spec

    run_id = f"artifact_safety_{os.getpid()}"
    values = {"epochs": 3, "prune": False, "export_formats": ["tflite"], "registered_model": "artifact-safety"}
    validate_spec(values, run_id)
    try:
        for stage in (prepare_data, provision_cluster, train):
            stage(run_id)
    finally:
        teardown_cluster(run_id)
    evaluation = evaluate(run_id)
    compress(run_id)
    export(run_id)
    return run_id, evaluation


@pytest.mark.slow
def test_the_replica_writes_weights_only_and_the_stages_read_them(pipeline_run):
    from hetflow.paths import run_paths

    run_id, evaluation = pipeline_run
    paths = run_paths(run_id)
    assert paths.model.name == "model.weights.h5" and not (paths.root / "model.keras").exists()
    with h5py.File(paths.model, "r") as file:
        assert "model_config" not in file.attrs
    assert evaluation["test_accuracy"] > 0.5  # the trained weights, not a fresh model's (chance is 0.1)


@pytest.mark.slow
def test_every_stage_refuses_a_hostile_model_file_and_its_code_never_runs(pipeline_run, tmp_path):
    from hetflow.models.architectures import WeightsError
    from hetflow.paths import run_paths
    from hetflow.tasks.compress import compress
    from hetflow.tasks.evaluate import evaluate
    from hetflow.tasks.export import export
    from hetflow.tasks.register import register

    run_id, _ = pipeline_run
    paths = run_paths(run_id)
    assert not paths.saved_model.exists()  # register rebuilds the model: its load is exercised too
    marker = tmp_path / "marker"
    hostile = hostile_hdf5(tmp_path, marker)
    trained = paths.model.read_bytes()
    # The replica's file under the pipeline's name, and under the name it had when it was a whole model.
    for path in (paths.model, paths.root / "model.keras"):
        shutil.copy(hostile, path)
    refusals, ran = {}, []
    try:
        # Last stage first: an attempt removes its own and later stages' records, which each reads.
        for stage, args in (
            (register, ("hetflow_train",)),
            (export, ()),
            (compress, ()),
            (evaluate, ()),
        ):
            try:
                stage(run_id, *args)
            except Exception as error:  # judged below, after whether the file's code ran
                refusals[stage.__name__] = error
            if marker.exists():
                ran.append(stage.__name__)
                marker.unlink()
    finally:
        paths.model.write_bytes(trained)
        (paths.root / "model.keras").unlink()
    assert ran == []
    assert sorted(refusals) == ["compress", "evaluate", "export", "register"]
    for error in refusals.values():
        message = str(error)
        assert isinstance(error, WeightsError) and "\n" not in message
        assert message.startswith(f"refusing {paths.model} as the weights of the mlp model: ")

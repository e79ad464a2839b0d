"""Compression and export: quantization modes, pruning schedule, the accept/reject rule."""

from __future__ import annotations

import gzip

import numpy as np
import pytest


@pytest.fixture(scope="module")
def model_and_images():
    from tasks.models import build_model

    images = np.random.default_rng(0).integers(0, 256, size=(64, 8, 8, 1), dtype=np.uint8)
    return build_model("mlp", [8, 8, 1], 10, seed=1), images


def test_each_quantization_mode_converts_and_shrinks_the_model(model_and_images, tmp_path):
    from tasks.predictors import tflite_predictor
    from tasks.tflite import to_tflite

    model, images = model_and_images
    sizes, logits = {}, {}
    for mode in ("none", "float16", "dynamic", "int8"):
        path = tmp_path / f"{mode}.tflite"
        path.write_bytes(to_tflite(model, mode, images))
        sizes[mode] = path.stat().st_size
        logits[mode] = tflite_predictor(path)(images)
    assert sizes["float16"] < 0.6 * sizes["none"]
    assert sizes["dynamic"] < 0.35 * sizes["none"] and sizes["int8"] < 0.35 * sizes["none"]
    reference = model.predict(images, verbose=0)
    np.testing.assert_allclose(logits["none"], reference, atol=1e-4)
    np.testing.assert_allclose(logits["float16"], reference, atol=5e-2)
    for mode in ("dynamic", "int8"):  # coarser, but still the same function
        assert np.corrcoef(logits[mode].ravel(), reference.ravel())[0, 1] > 0.95


def test_int8_variant_takes_raw_uint8_pixels(model_and_images, tmp_path):
    from ai_edge_litert.interpreter import Interpreter

    from tasks.tflite import to_tflite

    model, images = model_and_images
    path = tmp_path / "int8.tflite"
    path.write_bytes(to_tflite(model, "int8", images))
    interpreter = Interpreter(model_path=str(path))
    assert interpreter.get_input_details()[0]["dtype"] == np.uint8


def test_kernel_sparsity_is_measured_from_the_weights(model_and_images):
    from tasks.compress import kernel_sparsity
    from tasks.models import build_model

    model = build_model("mlp", [8, 8, 1], 10, seed=1)
    kernel = model.get_layer("logits").kernel
    values = kernel.numpy()
    values[: values.shape[0] // 4] = 0
    kernel.assign(values)
    sparsity = kernel_sparsity(model)
    assert sparsity["logits"] == pytest.approx(0.25, abs=0.01)
    assert len(sparsity) == 2 and "logits" in sparsity


def _artifact(fmt, accuracy, gzip_bytes, variant=None, difference=0.0):
    return {
        "format": fmt,
        "variant": variant,
        "test_accuracy": accuracy,
        "gzip_bytes": gzip_bytes,
        "max_logit_difference": difference,
    }


def test_judge_rejects_variants_beyond_the_accuracy_budget_and_picks_the_smallest_accepted():
    from tasks.export import judge

    artifacts = {
        "saved_model": _artifact("saved_model", 0.95, 50_000),
        "tflite_float": _artifact("tflite", 0.95, 40_000, "float"),
        "tflite_float_int8": _artifact("tflite", 0.945, 12_000, "float_int8"),
        "tflite_pruned_int8": _artifact("tflite", 0.90, 6_000, "pruned_int8"),
    }
    chosen = judge(artifacts, float_accuracy=0.95, max_accuracy_drop=0.01)
    assert chosen == "tflite_float_int8"
    assert artifacts["tflite_pruned_int8"]["accepted"] is False
    assert artifacts["tflite_pruned_int8"]["reason"] == "accuracy drop 0.0500 > max_accuracy_drop 0.01"
    assert artifacts["tflite_float_int8"]["accuracy_drop"] == pytest.approx(0.005)


def test_judge_fails_a_float_artifact_that_does_not_reproduce_the_model():
    from tasks.export import ParityError, judge

    artifacts = {"tflite_float": _artifact("tflite", 0.95, 40_000, "float", difference=0.5)}
    with pytest.raises(ParityError, match="tflite_float does not reproduce the float model"):
        judge(artifacts, float_accuracy=0.95, max_accuracy_drop=0.01)


# Issue 15: the digits CNN pruned to 80 % fell from 0.969 to chance (0.114). Over 4 seeds the fix
# lost -0.3 to 1.9 points (0.0 with seed 1, the one used here); every kernel pruned lost 7.8-12.3,
# the old fine-tuning budget (78 steps at a tenth of the rate) 15-42. Either half of that budget
# alone lost up to 3.1: below what one seed can tell from noise.
MAX_PRUNING_DROP = 0.03


def test_pruning_the_cnn_to_80_percent_keeps_its_accuracy_and_real_sparsity(tmp_path):
    import tensorflow as tf

    from tasks.compress import kernel_sparsity, prune, pruned_layers
    from tasks.data.pipeline import split_arrays, train_input
    from tasks.data.prepare import prepare_dataset
    from tasks.models import build_model, compile_model
    from tasks.predictors import tflite_predictor
    from tasks.schedule import steps_per_epoch
    from tasks.spec import RunSpec
    from tasks.tflite import to_tflite

    dataset = prepare_dataset("uci_digits", tmp_path / "data")
    spec = RunSpec(model="cnn", seed=1, prune=True, target_sparsity=0.8)
    model = build_model(spec.model, dataset["input_shape"], dataset["num_classes"], spec.seed)
    compile_model(model, tf.keras.optimizers.Adam(spec.learning_rate))
    batches = train_input(dataset, per_worker_batch=spec.batch_size, shuffle=True, seed=spec.seed)
    model.fit(batches, epochs=spec.epochs, steps_per_epoch=steps_per_epoch(spec, dataset), verbose=0)
    images, labels = split_arrays(dataset, "test")

    def accuracy(predict):
        return float(np.mean(np.argmax(predict(images), axis=1) == labels))

    float_accuracy = accuracy(lambda x: model.predict(x, verbose=0))
    pruned = prune(model, spec, dataset)
    assert accuracy(lambda x: model.predict(x, verbose=0)) == float_accuracy  # the float model is untouched

    sparsity = kernel_sparsity(pruned)
    chosen = pruned_layers(pruned)
    kernels = {layer.name: layer.kernel.shape.num_elements() for layer in pruned.layers if layer.name in sparsity}
    assert sum(kernels[name] for name in chosen) >= 0.95 * sum(kernels.values())  # the dense ones are small
    assert all(sparsity[name] >= 0.79 for name in chosen), sparsity
    assert accuracy(lambda x: pruned.predict(x, verbose=0)) >= float_accuracy - MAX_PRUNING_DROP

    # The zeros and the accuracy survive the export: the TFLite file is what is shipped.
    float_path, pruned_path = tmp_path / "float.tflite", tmp_path / "pruned.tflite"
    float_path.write_bytes(to_tflite(model, "none", images[:10]))
    pruned_path.write_bytes(to_tflite(pruned, "none", images[:10]))
    assert accuracy(tflite_predictor(pruned_path)) >= float_accuracy - MAX_PRUNING_DROP
    gzipped = {path: len(gzip.compress(path.read_bytes())) for path in (float_path, pruned_path)}
    assert gzipped[pruned_path] < 0.5 * gzipped[float_path]

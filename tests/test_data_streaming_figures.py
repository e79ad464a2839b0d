"""The stages stream the splits in batches and give the figures the whole-split code gave, to the
last digit, on the digits (floats from TensorFlow's kernels to float32's precision: ``close_float32``).

Every literal below was computed once, at commit b5526db (before streaming), by the whole-split code
path (``split_arrays`` of the split, ``model.predict`` and each artifact over it at once, the
calibration sample drawn from the whole train split in memory) on the run ``_trained_run`` makes
here: an MLP trained 10 epochs with seed 1, pruned to 80 %, quantized int8. The run is deterministic
(two runs of that code gave the same figures) and is made again by each test run.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from test_tasks_compress_and_export import _trained_run

CONFUSION = [
    [38, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [0, 36, 0, 0, 0, 0, 0, 0, 0, 0],
    [0, 1, 32, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 30, 0, 0, 0, 0, 1, 0],
    [0, 0, 0, 0, 30, 0, 0, 0, 1, 0],
    [0, 0, 0, 0, 0, 35, 0, 0, 0, 2],
    [0, 0, 0, 0, 0, 0, 39, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 40, 0, 0],
    [0, 2, 0, 0, 0, 0, 0, 0, 38, 0],
    [0, 2, 0, 0, 0, 0, 0, 1, 0, 31],
]
FLOAT_ACCURACY = 0.9721448467966574
PRUNED_ACCURACY = 0.9526462395543176
PRUNED_AGREEMENT = 0.9637883008356546
# export.json's figures per artifact: test accuracy, agreement with the float model, largest logit difference.
EXPORTED = {
    "saved_model": (FLOAT_ACCURACY, 1.0, 0.0),
    "tflite_float": (FLOAT_ACCURACY, 1.0, 1.9073486328125e-06),
    "tflite_pruned": (PRUNED_ACCURACY, PRUNED_AGREEMENT, 3.656710624694824),
    "tflite_float_int8": (FLOAT_ACCURACY, 1.0, 0.07943034172058105),
    "tflite_pruned_int8": (PRUNED_ACCURACY, PRUNED_AGREEMENT, 3.6223511695861816),
}
# The pruning fine-tuning's validation accuracy at each check (Keras's float32 figures).
FINE_TUNING_CHECKS = [
    [18, 0.949999988079071],
    [36, 0.9388889074325562],
    [54, 0.949999988079071],
    [72, 0.9111111164093018],
    [90, 0.9444444179534912],
    [108, 0.9444444179534912],
    [126, 0.9444444179534912],
    [144, 0.9388889074325562],
    [162, 0.9333333373069763],
    [180, 0.9333333373069763],
    [198, 0.949999988079071],
]
# sha256 of the bytes of the int8 calibration sample (200 train images) and of the served checks'
# input (the first 256 test images), as that code drew them.
CALIBRATION_SHA256 = "28e03a0a8941b6f3c18aa53ca7232e91401ef5c88db3441530e5feee2859b9c4"
SERVED_CHECK_SHA256 = "61ca34d3f67f0429efa405531db5d36fc189f990c9b551ad33d8f8974710b3b8"


def close_float32(value: float):
    """A float32 figure as recorded: the same to float32's precision. Counts (accuracies, agreements,
    confusion) must match exactly; a loss or logit difference differs in its last digits from one
    CPU's kernels to another's (the loss recorded at b5526db came out 8e-8 higher on an AMD EPYC)."""
    return pytest.approx(value, rel=1e-5, abs=1e-5)


def _sha256(images: np.ndarray) -> str:
    return hashlib.sha256(images.tobytes()).hexdigest()


def test_every_stage_gives_the_whole_split_figures_on_the_digits(tmp_path):
    from hetflow.artifacts.predictors import keras_predictor
    from hetflow.artifacts.scoring import streamed_accuracy
    from hetflow.artifacts.tflite import representative_images
    from hetflow.data.pipeline import split_batches, split_head
    from hetflow.models.architectures import trained_model
    from hetflow.serving.server import CHECK_EXAMPLES, REQUEST_BATCH
    from hetflow.tasks.compress import compress_model
    from hetflow.tasks.evaluate import scores_on_test_split
    from hetflow.tasks.export import export_artifacts

    spec, paths, dataset, training = _trained_run(
        tmp_path, model="mlp", epochs=10, export_formats=["saved_model", "tflite"]
    )
    assert dataset.splits == {"train": 1258, "validation": 180, "test": 359}  # two batches of the test split
    model = trained_model(spec, dataset, paths.model)

    evaluation = scores_on_test_split(model, dataset)
    assert (evaluation.test_accuracy, evaluation.test_examples) == (FLOAT_ACCURACY, 359)
    assert evaluation.test_loss == close_float32(0.1793539673089981)
    assert evaluation.confusion_matrix == CONFUSION

    compression = compress_model(spec, paths, dataset, training)
    assert compression.fine_tuning.validation_accuracy == [tuple(check) for check in FINE_TUNING_CHECKS]
    assert compression.fine_tuning.target_validation_accuracy == 0.9338888888888889
    for name, validation in {"float_int8": 0.9388888888888889, "pruned_int8": 0.95}.items():
        variant = compression.variants[name]
        assert variant.reference_validation_accuracy == validation
        assert variant.post_training_validation_accuracy == validation
        assert (variant.int8_method, variant.calibration_examples) == ("post_training", 200)

    exported = export_artifacts(spec, paths, dataset)
    assert exported.float_test_accuracy == FLOAT_ACCURACY
    figures = {
        name: (a.test_accuracy, a.agreement_with_float, a.max_logit_difference)
        for name, a in exported.artifacts.items()
    }
    assert figures == {name: (*counted, close_float32(logits)) for name, (*counted, logits) in EXPORTED.items()}
    assert exported.artifacts["tflite_pruned"].max_logit_difference_to_pruned == close_float32(2.384185791015625e-06)
    assert exported.chosen_tflite == "tflite_float_int8"

    # The calibration sample and the served checks' input are the images the whole-split code chose.
    assert _sha256(representative_images(dataset, spec.training.seed, 200)) == CALIBRATION_SHA256
    served_input, _ = split_head(dataset, "test", CHECK_EXAMPLES)
    assert served_input.shape == (256, 8, 8, 1) and _sha256(served_input) == SERVED_CHECK_SHA256
    # The champion comparison's loop, with the model where register serves the champion.
    batches = split_batches(dataset, "test", REQUEST_BATCH)
    assert streamed_accuracy(keras_predictor(model), batches) == FLOAT_ACCURACY


def test_the_images_at_given_positions_come_in_the_order_asked_from_one_pass(tmp_path):
    from hetflow.data.pipeline import split_arrays, split_images_at
    from hetflow.data.prepare import prepare_dataset

    dataset = prepare_dataset("uci_digits", tmp_path / "data")
    images, _ = split_arrays(dataset, "validation")  # 180: a batch and a part of one
    positions = np.array([179, 0, 255 % 180, 42, 100])
    np.testing.assert_array_equal(split_images_at(dataset, "validation", positions), images[positions])
    with pytest.raises(ValueError, match="positions up to 180 asked of split 'validation', which has 180 examples"):
        split_images_at(dataset, "validation", np.array([3, 180]))

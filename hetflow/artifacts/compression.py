"""Magnitude pruning (tensorflow-model-optimization) and post-training or quantization-aware int8:
what the compress stage (``hetflow.tasks.compress``) makes its variants with, and the compression
bench measures.

A pruned model is fine-tuned with a polynomial-decay sparsity schedule to ``target_sparsity`` in
every hidden kernel of at least ``MIN_PRUNED_WEIGHTS`` weights (smaller ones and the logits stay
dense), in blocks the TFLite converter can encode (``pruning_block``), then stripped of the pruning
wrappers. Post-training int8 that loses more than ``max_accuracy_drop`` against the Keras model it
was converted from (on the validation split) is replaced by quantization-aware fine-tuning with
tfmot's prune-preserving scheme (the pruned zeros stay zero): ``int8_file`` records which was
shipped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_model_optimization as tfmot

from hetflow.artifacts.predictors import keras_predictor, tflite_predictor
from hetflow.artifacts.scoring import streamed_accuracy
from hetflow.artifacts.tflite import representative_images, to_tflite
from hetflow.data.pipeline import split_arrays, split_batches, streamed_input, train_input
from hetflow.models.architectures import compile_model
from hetflow.models.fine_tuning import Recovery, fine_tune
from hetflow.models.schedule import make_optimizer
from hetflow.pipeline import timing
from hetflow.records import DatasetRecord
from hetflow.replica.training_json import TrainingRecord
from hetflow.spec import RunSpec

_PRUNABLE = (tf.keras.layers.Dense, tf.keras.layers.Conv2D)
# Smaller kernels stay dense: per-layer magnitude pruning leaves them one or two weights per unit
# (the CNN's first conv has 9 per filter: pruned alone one-shot to 80 %, accuracy 0.34), and they
# are a few percent of the weights (the CNN's first conv and logits: 928 of 23k).
MIN_PRUNED_WEIGHTS = 1_000
# A Dense kernel (inputs x units) is pruned in blocks of 16 inputs of one unit: the only shape in
# which the interpreter runs an int8 sparse fully connected layer (hetflow/artifacts/tflite.py). The logits stay
# dense: in such blocks the MLP's 128x10 logits pruned to 80 % cost 2.8 points (0.958 vs 0.986 after
# 1,000 fine-tuning steps; 0.986 with the logits dense), for 1,280 of its 9,472 weights.
DENSE_BLOCK = (16, 1)
# Fine-tuning is sized from the training run. Sparsity ramps up over RAMP_SHARE of the optimizer steps
# trained (at least MIN_RAMP_STEPS: a run of a few steps still ramps); the recovery at the target
# sparsity then stops as soon as validation accuracy is back within RECOVERED_WITHIN of the gate's
# budget (max_accuracy_drop) of the float model's, leaving the rest of the budget to quantization,
# or when it stops improving, at most spec.fine_tuning_share of the steps trained in all (ramp
# included, at least MIN_FINE_TUNING_STEPS). Measured at 80 % (seed 1, both models trained 40 epochs
# x 39 steps, pruned int8 file, a fixed 1,000 steps): MLP 0.986 (float 0.986), CNN 0.983 (float
# 0.972); with the MLP's logits pruned too, 500 steps left it at 0.866.
RAMP_SHARE = 0.375
MIN_RAMP_STEPS = 100
MIN_FINE_TUNING_STEPS = 200
RECOVERED_WITHIN = 0.5
# Validation rounds per ramp: the recovery is checked this often.
CHECKS_PER_RAMP = 8


def pruned_layers(model: tf.keras.Model) -> list[str]:
    """The layers whose kernels ``prune`` makes sparse."""
    return [
        layer.name
        for layer in model.layers
        if isinstance(layer, _PRUNABLE)
        and layer.name != "logits"
        and layer.kernel.shape.num_elements() >= MIN_PRUNED_WEIGHTS
    ]


def pruning_block(layer: tf.keras.layers.Layer) -> tuple[int, int]:
    """The block of weights pruned together in ``layer``'s kernel (see ``DENSE_BLOCK``); a Conv2D
    kernel is pruned weight by weight (its sparse encoding is densified when the file is loaded)."""
    if isinstance(layer, tf.keras.layers.Dense) and layer.kernel.shape[0] % DENSE_BLOCK[0] == 0:
        return DENSE_BLOCK
    return (1, 1)


def trained_steps(training: TrainingRecord) -> int:
    return training.epochs_done * training.steps_per_epoch


def longest_fine_tuning(spec: RunSpec, training: TrainingRecord) -> int:
    """The most optimizer steps the pruning fine-tuning may take (quantization-aware: half of it)."""
    return max(MIN_FINE_TUNING_STEPS, round(spec.compression.fine_tuning_share * trained_steps(training)))


def pruning_recovery(spec: RunSpec, training: TrainingRecord, float_validation_accuracy: float) -> Recovery:
    """When the pruning fine-tuning of a model trained as ``training`` (training.json) may stop."""
    ramp = max(MIN_RAMP_STEPS, round(RAMP_SHARE * trained_steps(training)))
    return Recovery(
        target_accuracy=float_validation_accuracy - RECOVERED_WITHIN * spec.export.max_accuracy_drop,
        max_steps=longest_fine_tuning(spec, training),
        check_every=max(1, ramp // CHECKS_PER_RAMP),
        first_check=ramp,
    )


# Keras's batch for validation arrays, kept for the streamed validation: fine-tuning's figures stay
# those computed on the whole split in batches of 32.
FIT_VALIDATION_BATCH = 32


def validation_split(dataset: DatasetRecord) -> str:
    """The split fine-tuning and the int8 choice are scored on (train where a dataset has none)."""
    return "validation" if "validation" in dataset.splits else "train"


def validation_arrays(dataset: DatasetRecord) -> tuple[np.ndarray, np.ndarray]:
    """``validation_split`` whole, as arrays: for the benches, which score it many times over."""
    return split_arrays(dataset, validation_split(dataset))


def validation_accuracy(predict, dataset: DatasetRecord) -> float:
    """``predict``'s accuracy on ``validation_split``, streamed in batches."""
    return streamed_accuracy(predict, split_batches(dataset, validation_split(dataset)))


def _fit_validation(dataset: DatasetRecord) -> tf.data.Dataset:
    return streamed_input(dataset, validation_split(dataset), FIT_VALIDATION_BATCH)


def prune(
    model: tf.keras.Model,
    spec: RunSpec,
    dataset: DatasetRecord,
    recovery: Recovery,
    callbacks: Sequence[tf.keras.callbacks.Callback] = (),
) -> tuple[tf.keras.Model, dict[str, Any]]:
    """Fine-tune while sparsity ramps from 0 to ``target_sparsity`` over ``recovery.first_check`` steps,
    then at that sparsity until ``recovery`` stops it; strip the wrappers. Returns the pruned model and
    the fine-tuning's record. ``callbacks`` see every round (the bench scores the test split there)."""
    # Masks are recomputed every `frequency` steps, and the last update must fall on end_step
    # for the final sparsity to be reached: end on a multiple of frequency.
    ramp_steps = recovery.first_check
    frequency = max(1, ramp_steps // 20)
    schedule = tfmot.sparsity.keras.PolynomialDecay(
        initial_sparsity=0.0,
        final_sparsity=spec.compression.target_sparsity,
        begin_step=0,
        end_step=frequency * (ramp_steps // frequency),
        frequency=frequency,
    )
    # prune_low_magnitude wraps layers in place and changes their weights: work on a copy (same
    # layer names), so the float model stays as trained.
    copy = tf.keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    chosen = set(pruned_layers(copy))

    def wrap(layer):
        if layer.name in chosen:
            return tfmot.sparsity.keras.prune_low_magnitude(
                layer, pruning_schedule=schedule, block_size=pruning_block(layer)
            )
        return layer

    pruning = tf.keras.models.clone_model(copy, clone_function=wrap)
    # The training optimizer at the training rate: at a tenth of it, an Adam step moves a weight by
    # at most 1e-4, too little to undo the loss (kernels' mean |w| is 0.1-0.2).
    compile_model(pruning, make_optimizer(spec, spec.training.learning_rate))
    record = fine_tune(
        pruning,
        _batches(spec, dataset),
        _fit_validation(dataset),
        recovery,
        "pruning fine-tuning",
        callbacks=[tfmot.sparsity.keras.UpdatePruningStep(), *callbacks],
    )
    return tfmot.sparsity.keras.strip_pruning(pruning), record


def _batches(spec: RunSpec, dataset: DatasetRecord) -> tf.data.Dataset:
    training = spec.training
    return train_input(
        dataset,
        per_worker_batch=training.batch_size,
        shuffle=training.shuffle,
        seed=training.seed,
        shuffle_buffer=training.shuffle_buffer,
        cache_budget_mb=training.cache_budget_mb,
    )


class _FloatWhereUnquantizable:
    """tfmot's prune-preserving registry, less the layers its own 8-bit registry cannot quantize: it
    counts every layer without weights as supported, Rescaling included, then fails to configure it
    when Rescaling feeds a quantized Conv2D (the CNN). Those layers stay float."""

    def __init__(self, registry, default_registry):
        self._registry, self._default_registry = registry, default_registry

    def supports(self, layer) -> bool:
        return self._registry.supports(layer) and self._default_registry.supports(layer)

    def get_quantize_config(self, layer):
        return self._registry.get_quantize_config(layer)


class _PrunePreservingScheme(tfmot.experimental.combine.Default8BitPrunePreserveQuantizeScheme):
    def get_quantize_registry(self):
        default = tfmot.quantization.keras.default_8bit.Default8BitQuantizeScheme().get_quantize_registry()
        return _FloatWhereUnquantizable(super().get_quantize_registry(), default)


def quantization_aware(
    model: tf.keras.Model, spec: RunSpec, dataset: DatasetRecord, recovery: Recovery
) -> tuple[tf.keras.Model, dict[str, Any]]:
    """Fine-tune ``model`` with fake int8 quantization of its Dense and Conv2D layers (inputs,
    weights, outputs), keeping its zero weights zero, until ``recovery`` stops it; convert the result
    with ``to_tflite``. Returns it and the fine-tuning's record."""
    copy = tf.keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    # Only the layers the 8-bit scheme knows: the whole-model annotation refuses Rescaling.
    annotated = tf.keras.models.clone_model(
        copy,
        clone_function=lambda layer: (
            tfmot.quantization.keras.quantize_annotate_layer(layer) if isinstance(layer, _PRUNABLE) else layer
        ),
    )
    quantized = tfmot.quantization.keras.quantize_apply(annotated, _PrunePreservingScheme())
    compile_model(quantized, make_optimizer(spec, spec.training.learning_rate))
    record = fine_tune(
        quantized, _batches(spec, dataset), _fit_validation(dataset), recovery, "quantization-aware fine-tuning"
    )
    return quantized, record


def keras_accuracy(model: tf.keras.Model, images: np.ndarray, labels: np.ndarray) -> float:
    """``model``'s accuracy on arrays already in memory (the benches')."""
    return streamed_accuracy(keras_predictor(model), [(images, labels)])


def int8_file(
    model: tf.keras.Model,
    spec: RunSpec,
    dataset: DatasetRecord,
    max_steps: int,
    sparse: bool,
    scratch: Path,
    representative: np.ndarray | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """The full-integer file of ``model``: post-training quantized, or, when that loses more than
    ``max_accuracy_drop`` against ``model`` on the validation split, quantization-aware fine-tuned
    (at most ``max_steps``, until within RECOVERED_WITHIN of the budget; kept only if it does better
    there); with how it was chosen. Calibrated on ``representative`` (drawn here where None: a
    pass over the train split, which compress makes once for all its variants)."""
    if representative is None:
        representative = representative_images(dataset, spec.training.seed, spec.compression.calibration_examples)
    reference = validation_accuracy(keras_predictor(model), dataset)

    def file_accuracy(data: bytes) -> float:
        scratch.write_bytes(data)
        try:
            return validation_accuracy(tflite_predictor(scratch), dataset)
        finally:
            scratch.unlink()

    post_training = to_tflite(model, "int8", representative, sparse=sparse)
    choice = {
        "calibration_examples": len(representative),
        "reference_validation_accuracy": reference,
        "post_training_validation_accuracy": file_accuracy(post_training),
    }
    if reference - choice["post_training_validation_accuracy"] <= spec.export.max_accuracy_drop:
        return post_training, {**choice, "int8_method": "post_training"}
    started = time.perf_counter()
    recovery = Recovery(
        target_accuracy=reference - RECOVERED_WITHIN * spec.export.max_accuracy_drop,
        max_steps=max_steps,
        check_every=max(1, max_steps // (2 * CHECKS_PER_RAMP)),
    )
    with timing.part("fine_tuning"):
        aware, fine_tuning = quantization_aware(model, spec, dataset, recovery)
    data = to_tflite(aware, "int8", representative, sparse=sparse)
    choice |= {
        "quantization_aware_steps": fine_tuning["steps"],
        "quantization_aware_fine_tuning": fine_tuning,
        "quantization_aware_seconds": time.perf_counter() - started,
        "quantization_aware_validation_accuracy": file_accuracy(data),
    }
    if choice["quantization_aware_validation_accuracy"] > choice["post_training_validation_accuracy"]:
        return data, {**choice, "int8_method": "quantization_aware"}
    return post_training, {**choice, "int8_method": "post_training"}


def kernel_sparsity(model: tf.keras.Model) -> dict[str, float]:
    """The measured fraction of exact zeros in each kernel."""
    return {
        layer.name: float(np.mean(layer.kernel.numpy() == 0)) for layer in model.layers if isinstance(layer, _PRUNABLE)
    }


def overall_sparsity(model: tf.keras.Model) -> float:
    """The measured fraction of exact zeros over all Dense and Conv2D kernels together."""
    kernels = [layer.kernel.numpy() for layer in model.layers if isinstance(layer, _PRUNABLE)]
    return float(sum(np.sum(k == 0) for k in kernels) / sum(k.size for k in kernels))

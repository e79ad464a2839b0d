"""compress: magnitude pruning (tensorflow-model-optimization) and post-training quantization.

Variants, each written as a TFLite file under ``compressed/``:
- ``float``: the trained model as is (the reference every other variant is measured against);
- ``pruned``: fine-tuned with a polynomial-decay sparsity schedule to ``target_sparsity``, then
  stripped of the pruning wrappers (``prune=true``);
- ``float_<quantize>``, ``pruned_<quantize>``: each quantized after training: ``dynamic`` (int8
  weights, float activations), ``float16`` (half-precision weights), ``int8`` (full integer,
  activations calibrated on a representative sample of the train split).

Quantization-aware training is not used: post-training int8 keeps these models within the
accuracy budget (``max_accuracy_drop``, checked by export), and QAT would add a second
fine-tuning pass to every run.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_model_optimization as tfmot

from tasks.data.pipeline import split_arrays, train_input
from tasks.models import build_model, compile_model
from tasks.paths import RunPaths
from tasks.spec import RunSpec
from tasks.strategies.common import steps_per_epoch

REPRESENTATIVE_EXAMPLES = 200
_PRUNABLE = (tf.keras.layers.Dense, tf.keras.layers.Conv2D)


def _copy_of(model: tf.keras.Model, spec: RunSpec, dataset: dict[str, Any]) -> tf.keras.Model:
    # prune_low_magnitude wraps layers in place and changes their weights: work on a copy, so
    # the float model stays as trained.
    copy = build_model(spec.model, dataset["input_shape"], dataset["num_classes"], spec.seed)
    copy.set_weights(model.get_weights())
    return copy


def prune(model: tf.keras.Model, spec: RunSpec, dataset: dict[str, Any]) -> tf.keras.Model:
    """Fine-tune ``prune_epochs`` while sparsity ramps from 0 to ``target_sparsity``; strip."""
    steps = steps_per_epoch(spec, dataset)
    total_steps = spec.prune_epochs * steps
    # Masks are recomputed every `frequency` steps, and the last update must fall on end_step
    # for the final sparsity to be reached: end on the last multiple of frequency.
    frequency = max(1, total_steps // 20)
    schedule = tfmot.sparsity.keras.PolynomialDecay(
        initial_sparsity=0.0,
        final_sparsity=spec.target_sparsity,
        begin_step=0,
        end_step=frequency * ((total_steps - 1) // frequency),
        frequency=frequency,
    )

    def wrap(layer):
        if isinstance(layer, _PRUNABLE):
            return tfmot.sparsity.keras.prune_low_magnitude(layer, pruning_schedule=schedule)
        return layer

    pruning = tf.keras.models.clone_model(_copy_of(model, spec, dataset), clone_function=wrap)
    # Fine-tuning continues from the trained weights at a tenth of the training rate.
    compile_model(pruning, tf.keras.optimizers.Adam(spec.learning_rate / 10))
    pruning.fit(
        train_input(dataset, per_worker_batch=spec.batch_size, shuffle=spec.shuffle, seed=spec.seed),
        epochs=spec.prune_epochs,
        steps_per_epoch=steps,
        callbacks=[tfmot.sparsity.keras.UpdatePruningStep()],
        verbose=2,
    )
    return tfmot.sparsity.keras.strip_pruning(pruning)


def kernel_sparsity(model: tf.keras.Model) -> dict[str, float]:
    """The measured fraction of exact zeros in each kernel."""
    return {
        layer.name: float(np.mean(layer.kernel.numpy() == 0)) for layer in model.layers if isinstance(layer, _PRUNABLE)
    }


def to_tflite(model: tf.keras.Model, quantize: str, representative: np.ndarray) -> bytes:
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    if quantize != "none":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if quantize == "float16":
        converter.target_spec.supported_types = [tf.float16]
    if quantize == "int8":
        converter.representative_dataset = lambda: ([image[np.newaxis]] for image in representative)
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        converter.inference_input_type = tf.uint8  # raw pixels in, as the float model takes them
    return converter.convert()


def compress(spec: RunSpec, paths: RunPaths, dataset: dict[str, Any]) -> dict[str, Any]:
    model = tf.keras.models.load_model(paths.model)
    paths.compressed.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"prune": spec.prune, "quantize": spec.quantize, "variants": {}}
    bases = {"float": model}
    if spec.prune:
        pruned = prune(model, spec, dataset)
        pruned.save(paths.compressed / "pruned.keras")
        record["target_sparsity"] = spec.target_sparsity
        record["kernel_sparsity"] = kernel_sparsity(pruned)
        bases["pruned"] = pruned
    if "tflite" in spec.export_formats:
        images, _ = split_arrays(dataset, "train")
        representative = np.random.default_rng(spec.seed).permutation(images)[:REPRESENTATIVE_EXAMPLES]
        conversions = [(name, base, "none") for name, base in bases.items()]
        if spec.quantize != "none":
            conversions += [(f"{name}_{spec.quantize}", base, spec.quantize) for name, base in bases.items()]
        for name, base, quantize in conversions:
            path = paths.compressed / f"{name}.tflite"
            path.write_bytes(to_tflite(base, quantize, representative))
            record["variants"][name] = {"path": str(path), "base": name.split("_")[0], "quantize": quantize}
    paths.compression.write_text(json.dumps(record, indent=2))
    return record

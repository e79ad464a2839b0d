"""compress: magnitude pruning (tensorflow-model-optimization) and post-training quantization.

Variants of the trained (float) model, each written as a TFLite file under ``compressed/`` (the
float model's own TFLite file is an export: ``hetflow.tasks.export``):
- ``pruned``: fine-tuned with a polynomial-decay sparsity schedule to ``target_sparsity`` in every
  hidden kernel of at least ``MIN_PRUNED_WEIGHTS`` weights (smaller ones and the logits stay
  dense), in blocks the TFLite converter can encode (``pruning_block``), then stripped of the
  pruning wrappers (``prune=true``); its weights are kept (``pruned.weights.h5``) so that export
  can check the pruned TFLite file against them;
- ``float_<quantize>``, ``pruned_<quantize>``: each quantized after training: ``dynamic`` (int8
  weights, float activations), ``float16`` (half-precision weights), ``int8`` (full integer,
  activations calibrated on a representative sample of the train split). When post-training int8
  loses more than ``max_accuracy_drop`` against the Keras model it was converted from (on the
  validation split), that model is fine-tuned quantization-aware instead, with tfmot's
  prune-preserving scheme (the pruned zeros stay zero), and the variant records which was shipped.

Pruned files are converted with sparsity-aware encoding where the interpreter runs it
(``hetflow.artifacts.tflite``): the zeros then make the file itself smaller. Each variant records the
encoding read back from its file.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import tensorflow as tf

from hetflow.artifacts.compression import (
    int8_file,
    kernel_sparsity,
    longest_fine_tuning,
    overall_sparsity,
    prune,
    pruned_layers,
    pruning_block,
    pruning_recovery,
    trained_steps,
    validation_accuracy,
)
from hetflow.artifacts.edge_metadata import variant_metadata, with_metadata
from hetflow.artifacts.litert_latency import litert_latency
from hetflow.artifacts.predictors import keras_predictor
from hetflow.artifacts.tflite import SPARSE_ENCODABLE, representative_images, to_tflite, weight_encoding
from hetflow.models.architectures import trained_model
from hetflow.paths import RunPaths, run_paths
from hetflow.pipeline import timing
from hetflow.pipeline.attempts import attempt, load_spec, reported
from hetflow.records import CompressionRecord, DatasetRecord, TfliteVariant
from hetflow.replica.training_json import TrainingRecord, read_training
from hetflow.spec import RunSpec

log = logging.getLogger("hetflow.stages")


@reported
def compress(run_id: str, try_number: int | None = None) -> dict[str, Any]:
    paths = run_paths(run_id)
    with attempt(paths, "compress", run_id, try_number) as receipt:
        spec, dataset = load_spec(paths), DatasetRecord.read(paths)
        record = compress_model(spec, paths, dataset, read_training(paths.training, spec, dataset))
    log.info("compressed variants: %s; kernel sparsity %s", list(record.variants), record.kernel_sparsity)
    return {**record.as_json(), "attempt": receipt}


def pruned_weights_path(paths: RunPaths):
    return paths.compressed / "pruned.weights.h5"


def compress_model(
    spec: RunSpec, paths: RunPaths, dataset: DatasetRecord, training: TrainingRecord
) -> CompressionRecord:
    """Prune (``prune=true``) and quantize (``quantize``) the trained model; writes compression.json."""
    model = trained_model(spec, dataset, paths.model)
    paths.compressed.mkdir(parents=True, exist_ok=True)
    bases = {"float": model}
    pruning: dict[str, Any] = {}  # the record's pruning fields: none without pruning
    if spec.compression.prune:
        with timing.part("fine_tuning"):
            bases["pruned"], pruning = _prune(model, spec, paths, dataset, training)
    variants, latency = {}, {}
    if "tflite" in spec.export.formats:
        representative = representative_images(dataset, spec.training.seed, spec.compression.calibration_examples)
        # Export writes the float file: converted here too, to be timed beside the variants.
        with timing.part("tflite_conversion"):
            float_file = to_tflite(model, "none")
        latency["float"] = litert_latency(float_file, representative[0])
        conversions = [("pruned", "pruned", "none")] if spec.compression.prune else []
        if spec.compression.quantize != "none":
            conversions += [(f"{base}_{spec.compression.quantize}", base, spec.compression.quantize) for base in bases]
        for name, base, quantize in conversions:
            sparse = base == "pruned" and quantize in SPARSE_ENCODABLE
            path = paths.compressed / f"{name}.tflite"
            with timing.part("tflite_conversion"):  # quantization-aware fine-tuning inside it counts as fine_tuning
                data, choice = _convert(bases[base], spec, dataset, training, quantize, representative, sparse, path)
            data = with_metadata(data, variant_metadata(bases[base], spec, dataset, name))
            path.write_bytes(data)
            latency[name] = litert_latency(data, representative[0])
            variants[name] = TfliteVariant(
                path=str(path),
                base=base,
                quantize=quantize,
                sparsity=overall_sparsity(bases[base]),
                **weight_encoding(data),
                **choice,
            )
    record = CompressionRecord(
        prune=spec.compression.prune,
        quantize=spec.compression.quantize,
        variants=variants,
        **({"litert_latency": latency} if latency else {}),
        **pruning,
    )
    record.write(paths)
    return record


def _convert(model, spec: RunSpec, dataset, training, quantize: str, representative, sparse: bool, path):
    """The TFLite file of ``model`` at ``quantize``, and (int8) which quantization was shipped."""
    if quantize != "int8":
        return to_tflite(model, quantize, representative, sparse=sparse), {}
    # At most half the pruning fine-tuning's maximum: enough to recover in the case
    # tests/test_tasks_compress_qat.py makes.
    aware_steps = longest_fine_tuning(spec, training) // 2
    return int8_file(model, spec, dataset, aware_steps, sparse, path.with_suffix(".probe"), representative)


def _prune(
    model: tf.keras.Model, spec: RunSpec, paths: RunPaths, dataset: DatasetRecord, training: TrainingRecord
) -> tuple[tf.keras.Model, dict[str, Any]]:
    """The pruned model, its weights kept for export's parity check, and the record's pruning fields."""
    started = time.perf_counter()
    recovery = pruning_recovery(spec, training, validation_accuracy(keras_predictor(model), dataset))
    pruned, fine_tuning = prune(model, spec, dataset, recovery)
    seconds = time.perf_counter() - started
    pruned.save_weights(pruned_weights_path(paths))
    layers = pruned_layers(pruned)
    return pruned, {
        "fine_tuning_seconds": seconds,
        "fine_tuning_steps": fine_tuning["steps"],
        "fine_tuning": fine_tuning,
        "trained_steps": trained_steps(training),
        "target_sparsity": spec.compression.target_sparsity,
        "pruned_layers": layers,
        "pruning_blocks": {name: list(pruning_block(pruned.get_layer(name))) for name in layers},
        "kernel_sparsity": kernel_sparsity(pruned),
        "sparsity": overall_sparsity(pruned),
        "pruned_weights": str(pruned_weights_path(paths)),
    }

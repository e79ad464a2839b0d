"""export: the float model as a SavedModel for serving and as a TFLite file, and every artifact
(those and compress's variants) re-loaded and scored on the test split.

Each artifact is loaded back from disk the way a consumer would (``hetflow.artifacts.predictors``) and scored
on the whole test split: accuracy, agreement with the float model, size raw and gzipped, latency
per example at batch 1, sparsity and how the file encodes its weights. Float artifacts must
reproduce the Keras model they were converted from (parity): the float model's, and the pruned
model's (its weights kept by compress) for the sparse ``pruned`` file. A compressed variant more
than ``max_accuracy_drop`` below the float model is rejected, not deployable; of the accepted
TFLite files, the smallest on disk ships (no consumer of the registered model gets it gzipped).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from hetflow import plots
from hetflow.artifacts.edge_metadata import variant_metadata, with_metadata
from hetflow.artifacts.predictors import saved_model_predictor, tflite_predictor
from hetflow.artifacts.saved_model import save_serving_model
from hetflow.artifacts.scoring import judge, score, sizes
from hetflow.artifacts.tflite import to_tflite, weight_encoding
from hetflow.data.pipeline import split_arrays
from hetflow.models.architectures import trained_model
from hetflow.paths import RunPaths, run_paths
from hetflow.pipeline.attempts import attempt, load_spec, reported
from hetflow.records import CompressionRecord, DatasetRecord, ExportRecord, TfliteVariant
from hetflow.spec import RunSpec

log = logging.getLogger("hetflow.stages")


@reported
def export(run_id: str, try_number: int | None = None) -> dict[str, Any]:
    paths = run_paths(run_id)
    with attempt(paths, "export", run_id, try_number) as receipt:
        exported = export_artifacts(load_spec(paths), paths, DatasetRecord.read(paths))
    for name, artifact in exported.artifacts.items():
        log.info(
            "%s: accuracy %.4f (drop %+.4f), %d bytes (%d gzipped), %s weights, sparsity %.3f, %.4f ms/example%s",
            name,
            artifact.test_accuracy,
            artifact.accuracy_drop,
            artifact.bytes,
            artifact.gzip_bytes,
            artifact.encoding or "dense",
            artifact.sparsity or 0.0,
            artifact.latency_ms,
            "" if artifact.accepted else f" -- rejected: {artifact.reason}",
        )
    return {
        "chosen_tflite": exported.chosen_tflite,
        "float_test_accuracy": exported.float_test_accuracy,
        "attempt": receipt,
    }


def export_artifacts(spec: RunSpec, paths: RunPaths, dataset: DatasetRecord) -> ExportRecord:
    """Write the float model's artifacts, score them and compress's variants, choose the TFLite
    variant to deploy; writes export.json and the size-vs-accuracy plot."""
    model = trained_model(spec, dataset, paths.model)
    images, labels = split_arrays(dataset, "test")
    float_logits = model.predict(images, batch_size=256, verbose=0)
    float_accuracy = float(np.mean(np.argmax(float_logits, axis=1) == labels))
    compression = CompressionRecord.read(paths)  # at the run directory's top, where replicas write
    tflite_variants = {}
    if "tflite" in spec.export.formats:
        paths.float_tflite.parent.mkdir(parents=True, exist_ok=True)
        data = with_metadata(to_tflite(model, "none"), variant_metadata(model, spec, dataset, "float"))
        paths.float_tflite.write_bytes(data)
        tflite_variants["float"] = TfliteVariant(  # not pruned: reported as sparsity 0
            path=str(paths.float_tflite), base="float", quantize="none", sparsity=0.0, **weight_encoding(data)
        )
    tflite_variants |= compression.variants
    pruned_logits = None
    if "pruned" in tflite_variants:
        pruned = trained_model(spec, dataset, Path(compression.pruned_weights))
        pruned_logits = pruned.predict(images, batch_size=256, verbose=0)

    # Dicts until judged: judge adds each one's verdict.
    artifacts: dict[str, dict[str, Any]] = {}
    if "saved_model" in spec.export.formats:
        save_serving_model(model, paths.saved_model, dataset)
        artifacts["saved_model"] = {
            "format": "saved_model",
            "path": str(paths.saved_model),
            "weights_bytes": sum(p.stat().st_size for p in (paths.saved_model / "variables").iterdir()),
            **sizes(paths.saved_model),
            **score(saved_model_predictor(paths.saved_model), images, labels, float_logits),
        }
    for name, variant in tflite_variants.items():
        path = Path(variant.path)
        predict = tflite_predictor(path)
        artifacts[f"tflite_{name}"] = {
            "format": "tflite",
            "variant": name,
            "quantize": variant.quantize,
            "pruned": variant.base == "pruned",
            "sparsity": variant.sparsity,
            "encoding": variant.encoding,
            "sparse_tensors": variant.sparse_tensors,
            # int8 only: post_training, or quantization_aware where post-training lost too much (compress)
            "int8_method": variant.int8_method,
            "path": str(path),
            **sizes(path),
            **score(predict, images, labels, float_logits),
        }
        if name == "pruned":
            difference = np.max(np.abs(predict(images) - pruned_logits))
            artifacts[f"tflite_{name}"]["max_logit_difference_to_pruned"] = float(difference)

    chosen = judge(artifacts, float_accuracy, spec.export.max_accuracy_drop)
    exported = ExportRecord(float_test_accuracy=float_accuracy, artifacts=artifacts, chosen_tflite=chosen)
    paths.plots.mkdir(parents=True, exist_ok=True)
    plots.size_vs_accuracy(exported.artifacts, float_accuracy, paths.plots / "size_vs_accuracy.png")
    exported.write(paths)
    return exported

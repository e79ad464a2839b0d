"""export: the float model as a SavedModel for serving and as a TFLite file, and every artifact
(those and compress's variants) re-loaded and scored on the test split.

Each artifact is loaded back from disk the way a consumer would (``hetflow.artifacts.predictors``) and scored
on the whole test split, streamed in batches that every artifact and the float model see together
(one batch held at a time): accuracy, agreement with the float model, size raw and gzipped, latency
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

from hetflow import plots
from hetflow.artifacts.edge_metadata import variant_metadata, with_metadata
from hetflow.artifacts.predictors import keras_predictor, saved_model_predictor, tflite_predictor
from hetflow.artifacts.saved_model import save_serving_model
from hetflow.artifacts.scoring import LATENCY_EXAMPLES, judge, latency_ms, score_split, sizes
from hetflow.artifacts.tflite import to_tflite, weight_encoding
from hetflow.data.pipeline import split_batches, split_head
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

    # Dicts until judged: judge adds each one's verdict.
    artifacts: dict[str, dict[str, Any]] = {}
    predictors = {}
    if "saved_model" in spec.export.formats:
        save_serving_model(model, paths.saved_model, dataset)
        predictors["saved_model"] = saved_model_predictor(paths.saved_model)
        artifacts["saved_model"] = {
            "format": "saved_model",
            "path": str(paths.saved_model),
            "weights_bytes": sum(p.stat().st_size for p in (paths.saved_model / "variables").iterdir()),
            **sizes(paths.saved_model),
        }
    for name, variant in tflite_variants.items():
        path = Path(variant.path)
        predictors[f"tflite_{name}"] = tflite_predictor(path)
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
        }
    # The sparse pruned file must compute what the pruned Keras model (its weights kept by compress) does.
    parity = {}
    if "pruned" in tflite_variants:
        parity["tflite_pruned"] = keras_predictor(trained_model(spec, dataset, Path(compression.pruned_weights)))
    float_accuracy, scores, to_pruned = score_split(
        predictors, keras_predictor(model), split_batches(dataset, "test"), parity
    )
    latency_images, _ = split_head(dataset, "test", LATENCY_EXAMPLES)
    for name, predict in predictors.items():
        artifacts[name] |= {**scores[name], "latency_ms": latency_ms(predict, latency_images)}
    for name, difference in to_pruned.items():
        artifacts[name]["max_logit_difference_to_pruned"] = difference

    chosen = judge(artifacts, float_accuracy, spec.export.max_accuracy_drop)
    exported = ExportRecord(float_test_accuracy=float_accuracy, artifacts=artifacts, chosen_tflite=chosen)
    paths.plots.mkdir(parents=True, exist_ok=True)
    plots.size_vs_accuracy(exported.artifacts, float_accuracy, paths.plots / "size_vs_accuracy.png")
    exported.write(paths)
    return exported

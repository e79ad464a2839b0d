"""compress and export on a model trained here: every TFLite file they write carries the TFLite
metadata of the run (named for the registered TFLite model, not yet registered, the dataset's class
names as labels.txt), and compress measures each variant's LiteRT latency, the float file's too."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def test_every_tflite_file_of_a_run_carries_its_metadata_and_every_variant_its_latency(tmp_path):
    from ai_edge_litert.interpreter import Interpreter
    from test_tasks_compress_and_export import _trained_run

    from hetflow.artifacts.edge_metadata import read_metadata
    from hetflow.tasks.compress import compress_model
    from hetflow.tasks.export import export_artifacts

    spec, paths, dataset, training = _trained_run(
        tmp_path, model="mlp", epochs=2, prune=False, quantize="int8", registered_model="digits-edge"
    )
    compression = compress_model(spec, paths, dataset, training)
    exported = export_artifacts(spec, paths, dataset)

    files = sorted(Path(a.path).name for a in exported.artifacts.values())
    assert files == ["float.tflite", "float_int8.tflite"]
    for artifact in exported.artifacts.values():
        data = Path(artifact.path).read_bytes()
        metadata = read_metadata(data)
        assert (metadata.name, metadata.version) == ("digits-edge-tflite", "unregistered")
        assert metadata.labels == tuple(str(digit) for digit in range(10)) == tuple(dataset.class_names)
        assert (metadata.mean, metadata.std, metadata.image_shape) == ((0.0,), (255.0,), (8, 8, 1))
        assert f"TFLite variant {artifact.variant}" in metadata.description
        # Still the file export scored: it runs its named signature and agrees with the float model.
        runner = Interpreter(model_content=data).get_signature_runner("serving_default")
        assert runner(image=np.zeros((1, 8, 8, 1), np.uint8))["logits"].shape == (1, 10)
        assert artifact.agreement_with_float > 0.9

    assert sorted(compression.litert_latency) == ["float", "float_int8"]
    for latency in compression.litert_latency.values():
        assert latency.invokes == 200 and sorted(latency.threads) == [1, 2]
        assert all(0 < f.p50_ms <= f.p95_ms for f in latency.threads.values())

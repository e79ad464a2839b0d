"""The registered TFLite model, sparse-encoded, loads through mlflow.pyfunc in a clean process."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

LOAD_AND_PREDICT = """
import sys, numpy as np, mlflow
model = mlflow.pyfunc.load_model(sys.argv[1])
np.save(sys.argv[3], np.asarray(model.predict(np.load(sys.argv[2]))))
"""


def test_a_sparse_int8_file_registered_loads_and_predicts_through_pyfunc_in_a_clean_process(tmp_path):
    from hetflow.artifacts.edge_metadata import UNREGISTERED, EdgeMetadata, with_metadata
    from hetflow.artifacts.predictors import tflite_predictor
    from hetflow.artifacts.tflite import to_tflite, weight_encoding
    from hetflow.models.architectures import build_model
    from hetflow.registry import store, versions

    images = np.random.default_rng(0).integers(0, 256, size=(64, 8, 8, 1), dtype=np.uint8)
    model = build_model("mlp", [8, 8, 1], 10, seed=1)
    [hidden] = [layer for layer in model.layers if layer.name != "logits" and hasattr(layer, "kernel")]
    kernel = hidden.kernel.numpy()  # 64 inputs x 128 units: each unit keeps one block of 16 inputs in 4
    blocks = np.arange(kernel.shape[0] // 16)[:, None] != (np.arange(kernel.shape[1]) % 4)[None, :]
    kernel[np.repeat(blocks, 16, axis=0)] = 0
    hidden.kernel.assign(kernel)
    path = tmp_path / "pruned_int8.tflite"
    # Every TFLite file hetflow writes carries its metadata, which register's copy updates.
    metadata = EdgeMetadata("sparse-tflite", UNREGISTERED, "test", "image", "logits", (8, 8, 1), (0.0,), (255.0,), ())
    path.write_bytes(with_metadata(to_tflite(model, "int8", images, sparse=True), metadata))
    assert weight_encoding(path.read_bytes())["encoding"] == "sparse"

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = store.client(uri)
    run = client.create_run(client.create_experiment("sparse-tflite", artifact_location=(tmp_path / "a").as_uri()))
    versions.own_registered_model(client, "sparse-tflite", "sparse-tflite")
    versions.register_version(
        client,
        "sparse-tflite",
        run.info.run_id,
        "tflite_model",
        versions.tflite_saver(str(path), images, tflite_predictor(path)),
    )
    np.save(tmp_path / "images.npy", images)
    # A clean process: not the checkout, none of hetflow's environment (TF_USE_LEGACY_KERAS included).
    env = {key: value for key, value in os.environ.items() if key != "TF_USE_LEGACY_KERAS"}
    env["MLFLOW_TRACKING_URI"] = uri
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AND_PREDICT, "models:/sparse-tflite/1", "images.npy", "logits.npy"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy"), tflite_predictor(path)(images))

"""The edge bundle against a real MLflow store: a TFLite version registered as register does it
carries its version number in its metadata, and its manifest (version, sha256, size, latency,
metadata) and file are what a device gets for the champion; a file that is not the registered one is
not handed out."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

NAME = "hetflow-digits-tflite"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A store holding two TFLite versions of NAME registered from one file (each test sets the alias)."""
    from hetflow.artifacts.edge_metadata import EdgeMetadata, with_metadata
    from hetflow.artifacts.predictors import tflite_predictor
    from hetflow.artifacts.tflite import to_tflite
    from hetflow.models.architectures import build_model
    from hetflow.records import LatencyFigures, LiteRTLatency
    from hetflow.registry import store, versions

    tmp_path = tmp_path_factory.mktemp("edge")
    images = np.random.default_rng(0).integers(0, 256, size=(16, 8, 8, 1), dtype=np.uint8)
    model = build_model("mlp", [8, 8, 1], 10, seed=1)
    metadata = EdgeMetadata(
        NAME, "unregistered", "an mlp", "image", "logits", (8, 8, 1), (0.0,), (255.0,), tuple("0123456789")
    )
    path = tmp_path / "pruned_int8.tflite"
    path.write_bytes(with_metadata(to_tflite(model, "int8", images), metadata))

    client = store.client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("edge", artifact_location=(tmp_path / "artifacts").as_uri())
    versions.own_registered_model(client, NAME, "hetflow-digits")
    latency = {
        "pruned_int8": LiteRTLatency(
            invokes=200,
            seconds=0.1,
            threads={1: LatencyFigures(p50_ms=0.05, p95_ms=0.07), 2: LatencyFigures(p50_ms=0.04, p95_ms=0.06)},
        ),
        "float": LiteRTLatency(
            invokes=200,
            seconds=0.1,
            threads={1: LatencyFigures(p50_ms=0.1, p95_ms=0.2), 2: LatencyFigures(p50_ms=0.1, p95_ms=0.3)},
        ),
    }
    for _ in range(2):
        run = client.create_run(experiment)
        save = versions.tflite_saver(str(path), images, tflite_predictor(path))
        version = versions.register_version(client, NAME, run.info.run_id, "tflite_model", save)
        for key, value in versions.latency_tags(latency, "pruned_int8").items():
            client.set_model_version_tag(NAME, version.version, key, value)
    return client, path, images


def test_the_champion_s_manifest_names_the_registered_file_and_its_figures(registry, tmp_path):
    from hetflow.serving.edge import edge_manifest, fetch_edge_file

    client, _, _ = registry
    client.set_registered_model_alias(NAME, "champion", "1")
    manifest = edge_manifest(client, NAME)
    fetched = fetch_edge_file(client, NAME, manifest["version"], tmp_path / "device")
    data = fetched.read_bytes()
    assert (manifest["model"], manifest["version"], manifest["alias"]) == (NAME, 1, "champion")
    assert (manifest["file"], fetched.name) == ("pruned_int8.tflite", f"{NAME}-v1.tflite")
    assert manifest["sha256"] == hashlib.sha256(data).hexdigest() and manifest["size_bytes"] == len(data)
    assert manifest["latency_ms"] == {"1": {"p50_ms": 0.05, "p95_ms": 0.07}, "2": {"p50_ms": 0.04, "p95_ms": 0.06}}
    assert manifest["metadata"]["version"] == "1" and manifest["metadata"]["name"] == NAME
    assert manifest["metadata"]["labels"] == list("0123456789")
    assert manifest["metadata"]["input"]["std"] == [255.0]
    # Every variant's figures are on the version page, the registered file's under the plain tag.
    tags = client.get_model_version(NAME, "1").tags
    assert tags["litert.latency_ms"] == "p50 0.0500 / p95 0.0700 ms (1 thread); p50 0.0400 / p95 0.0600 ms (2 threads)"
    assert tags["litert.latency_ms.float"].startswith("p50 0.1000 / p95 0.2000 ms (1 thread)")


def test_each_registered_file_says_its_own_version_and_runs_as_the_run_s_file(registry, tmp_path):
    from ai_edge_litert.interpreter import Interpreter

    from hetflow.artifacts.edge_metadata import read_metadata
    from hetflow.serving.edge import edge_manifest, fetch_edge_file, version_manifest

    client, path, images = registry
    client.set_registered_model_alias(NAME, "champion", "2")
    manifest = edge_manifest(client, NAME)
    second = fetch_edge_file(client, NAME, 2, tmp_path / "device")
    first = fetch_edge_file(client, NAME, 1, tmp_path / "device")
    assert manifest["version"] == 2 and read_metadata(second.read_bytes()).version == "2"
    assert read_metadata(first.read_bytes()).version == "1"
    # The version is in the bytes: each version's file is its own, with its own sha256.
    assert version_manifest(client, NAME, 1)["sha256"] == hashlib.sha256(first.read_bytes()).hexdigest()
    assert manifest["sha256"] != version_manifest(client, NAME, 1)["sha256"]

    def logits(file):
        runner = Interpreter(model_path=str(file)).get_signature_runner("serving_default")
        return runner(image=images[:1])["logits"]

    np.testing.assert_array_equal(logits(second), logits(path))


def test_a_file_that_is_not_the_registered_one_is_not_handed_out(registry, tmp_path):
    from hetflow.serving.edge import EdgeBundleError, edge_manifest, fetch_edge_file

    client, _, _ = registry
    tags = {v: client.get_model_version(NAME, v).tags for v in ("1", "2")}
    try:
        client.set_model_version_tag(NAME, "1", "edge.sha256", "0" * 64)
        with pytest.raises(EdgeBundleError, match="its manifest says 0000"):
            fetch_edge_file(client, NAME, 1, tmp_path / "device")
        assert list((tmp_path / "device").iterdir()) == []  # no file, and no partial copy
        client.delete_model_version_tag(NAME, "2", "edge.metadata")
        client.set_registered_model_alias(NAME, "champion", "2")
        with pytest.raises(EdgeBundleError, match="version 2 has no edge bundle \\(tags edge.metadata missing\\)"):
            edge_manifest(client, NAME)
        with pytest.raises(EdgeBundleError, match="no version at alias 'stable'"):
            edge_manifest(client, NAME, "stable")
    finally:
        for version, kept in tags.items():
            for key in ("edge.sha256", "edge.metadata"):
                client.set_model_version_tag(NAME, version, key, kept[key])

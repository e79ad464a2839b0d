"""TFLite metadata on hetflow's TFLite files: read back by LiteRT (the named signature, run) and by
flatc against TFLite Support's schema (name, version, normalization, labels.txt packed as the
populator packs it), the outputs unchanged; and each file's LiteRT latency."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import zipfile

import numpy as np
import pytest
from conftest import REPO

SCHEMA = REPO / "tests" / "schemas" / "tflite_metadata_schema.fbs"
LABELS = tuple("zero one two three four five six seven eight nine".split())


@pytest.fixture(scope="module")
def model_and_images():
    from hetflow.models.architectures import build_model

    images = np.random.default_rng(0).integers(0, 256, size=(32, 8, 8, 1), dtype=np.uint8)
    return build_model("mlp", [8, 8, 1], 10, seed=1), images


def _metadata(model, version="unregistered"):
    from hetflow.artifacts.edge_metadata import EdgeMetadata, model_normalization

    mean, std = model_normalization(model)
    return EdgeMetadata("hetflow-digits-tflite", version, "an mlp", "image", "logits", (8, 8, 1), mean, std, LABELS)


def _run_signature(data: bytes, images: np.ndarray) -> tuple[dict, np.ndarray]:
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_content=data)
    runner = interpreter.get_signature_runner("serving_default")
    logits = np.concatenate([runner(image=image[np.newaxis])["logits"] for image in images])
    return interpreter.get_signature_list(), logits


def _flatc_metadata(data: bytes, tmp_path) -> dict:
    """The TFLITE_METADATA buffer decoded by flatc (Google's reader of the schema), not by hetflow."""
    from ai_edge_litert import schema_py_generated as schema

    if shutil.which("flatc") is None:
        pytest.skip("flatc missing: make test-deps installs Debian's flatbuffers-compiler")
    model = schema.ModelT.InitFromPackedBuf(data, 0)
    [entry] = [m for m in model.metadata if m.name == b"TFLITE_METADATA"]
    raw = bytes(np.asarray(model.buffers[entry.buffer].data, dtype=np.uint8))
    (tmp_path / "metadata.bin").write_bytes(raw)
    subprocess.run(
        ["flatc", "--json", "--strict-json", "--raw-binary", "-o", str(tmp_path), str(SCHEMA), "--", "metadata.bin"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    return json.loads((tmp_path / "metadata.json").read_text())


def _pruned(model):
    """``model`` with its hidden kernel zero in 3 of every 4 blocks of 16 inputs: what the sparse encoding stores."""
    import tensorflow as tf

    pruned = tf.keras.models.clone_model(model)
    pruned.set_weights(model.get_weights())
    [hidden] = [layer for layer in pruned.layers if layer.name != "logits" and hasattr(layer, "kernel")]
    kernel = hidden.kernel.numpy()
    blocks = np.arange(kernel.shape[0] // 16)[:, None] != (np.arange(kernel.shape[1]) % 4)[None, :]
    kernel[np.repeat(blocks, 16, axis=0)] = 0
    hidden.kernel.assign(kernel)
    return pruned


@pytest.mark.parametrize("variant", ["float", "float_int8", "pruned", "pruned_int8"])
def test_a_file_with_metadata_runs_its_named_signature_as_before_and_says_what_it_is(
    model_and_images, variant, tmp_path
):
    from hetflow.artifacts.edge_metadata import with_metadata
    from hetflow.artifacts.tflite import to_tflite, weight_encoding

    model, images = model_and_images
    pruned = variant.startswith("pruned")
    quantize = "int8" if variant.endswith("int8") else "none"
    plain = to_tflite(_pruned(model) if pruned else model, quantize, images, sparse=pruned)
    assert weight_encoding(plain)["encoding"] == ("sparse" if pruned else "dense")
    data = with_metadata(plain, _metadata(model))
    assert weight_encoding(data) == weight_encoding(plain)  # the sparsity metadata kept through the repacking
    print(f"{variant}: {len(plain)} bytes, {len(data)} with metadata (+{len(data) - len(plain)})")

    signatures, logits = _run_signature(data, images)
    assert signatures == {"serving_default": {"inputs": ["image"], "outputs": ["logits"]}}
    np.testing.assert_array_equal(logits, _run_signature(plain, images)[1])

    decoded = _flatc_metadata(data, tmp_path)
    assert (decoded["name"], decoded["version"], decoded["min_parser_version"]) == (
        "hetflow-digits-tflite",
        "unregistered",
        "1.0.0",
    )
    [subgraph] = decoded["subgraph_metadata"]
    [image], [output] = subgraph["input_tensor_metadata"], subgraph["output_tensor_metadata"]
    assert (subgraph["name"], image["name"], output["name"]) == ("serving_default", "image", "logits")
    # Rescaling(1/255): (pixel - 0) / 255.
    [unit] = image["process_units"]
    assert unit["options_type"] == "NormalizationOptions"
    assert unit["options"] == {"mean": [0.0], "std": [255.0]}
    assert image["content"]["content_properties"] == {
        "color_space": "GRAYSCALE",
        "default_size": {"width": 8, "height": 8},
    }
    assert output["associated_files"] == [
        {
            "name": "labels.txt",
            "description": "The class names, one per line, in the logits' order.",
            "type": "TENSOR_AXIS_LABELS",
        }
    ]
    # Packed as TFLite Support packs associated files: a zip after the model, whose offsets a zip reader finds.
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.namelist() == ["labels.txt"]
        assert archive.read("labels.txt") == b"zero\none\ntwo\nthree\nfour\nfive\nsix\nseven\neight\nnine\n"


def test_register_s_copy_says_its_version_and_the_bytes_follow_the_metadata(model_and_images, tmp_path):
    from hetflow.artifacts.edge_metadata import read_metadata, with_metadata, with_version
    from hetflow.artifacts.tflite import to_tflite

    model, images = model_and_images
    plain = to_tflite(model, "none")
    data = with_metadata(plain, _metadata(model))
    registered = with_version(data, "12")
    assert _flatc_metadata(registered, tmp_path)["version"] == "12"
    assert read_metadata(registered).labels == LABELS
    np.testing.assert_array_equal(_run_signature(registered, images)[1], _run_signature(plain, images)[1])
    # Written again, the same metadata gives the same bytes (a registered file's sha256 is reproducible);
    # the metadata replaced, not added: one entry, one zip entry.
    assert with_version(registered, "unregistered") == data
    with zipfile.ZipFile(io.BytesIO(registered)) as archive:
        assert archive.namelist() == ["labels.txt"]


def test_the_normalization_is_the_model_s_own(tmp_path):
    import tensorflow as tf

    from hetflow.artifacts.edge_metadata import model_normalization

    pixels = tf.keras.Input(shape=(4, 4, 3), dtype=tf.uint8)
    scaled = tf.keras.layers.Rescaling(1.0 / 127.5, offset=-1.0)(pixels)
    model = tf.keras.Model(pixels, tf.keras.layers.Dense(2)(tf.keras.layers.Flatten()(scaled)))
    # (x / 127.5) - 1 == (x - 127.5) / 127.5
    assert model_normalization(model) == (pytest.approx((127.5,)), pytest.approx((127.5,)))


def test_a_file_whose_signature_is_not_the_metadata_s_is_refused(model_and_images):
    from dataclasses import replace

    from hetflow.artifacts.edge_metadata import MetadataError, read_metadata, with_metadata
    from hetflow.artifacts.tflite import to_tflite

    model, _ = model_and_images
    plain = to_tflite(model, "none")
    with pytest.raises(MetadataError, match="expected serving_default with inputs/outputs"):
        with_metadata(plain, replace(_metadata(model), input_name="pixels"))
    with pytest.raises(MetadataError, match="has no TFLITE_METADATA metadata"):
        read_metadata(plain)


def test_litert_latency_has_both_thread_counts_bounded_and_reads_back_from_its_tag(model_and_images):
    from hetflow.artifacts.edge_metadata import with_metadata
    from hetflow.artifacts.litert_latency import latency_line, litert_latency, parse_latency_line
    from hetflow.artifacts.tflite import to_tflite
    from hetflow.records import LatencyFigures, LiteRTLatency

    model, images = model_and_images
    latency = litert_latency(with_metadata(to_tflite(model, "none"), _metadata(model)), images[0])
    print(latency)
    assert latency.invokes == 200 and sorted(latency.threads) == [1, 2]
    for figures in latency.threads.values():
        assert 0 < figures.p50_ms <= figures.p95_ms < 50  # an 8x8 MLP: far under a millisecond
    assert latency.seconds < 30

    written = LiteRTLatency(
        invokes=200,
        seconds=1.0,
        threads={1: LatencyFigures(p50_ms=0.0512, p95_ms=0.07), 2: LatencyFigures(p50_ms=0.04, p95_ms=0.0649)},
    )
    line = latency_line(written)
    assert line == "p50 0.0512 / p95 0.0700 ms (1 thread); p50 0.0400 / p95 0.0649 ms (2 threads)"
    assert parse_latency_line(line) == {
        "1": {"p50_ms": 0.0512, "p95_ms": 0.07},
        "2": {"p50_ms": 0.04, "p95_ms": 0.0649},
    }

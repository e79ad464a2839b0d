"""The records stages hand each other (hetflow/records.py, and training.json's TrainingRecord, which
the trust boundary's reader checks): typed, read and written through their model at the path RunPaths
gives, and never read by string key anywhere in the pipeline."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from conftest import REPO
from pydantic import ValidationError

from hetflow.paths import RunPaths
from hetflow.records import CompressionRecord, DatasetRecord, ExportRecord, StageRecord

_READERS = {"read_record", "read_replica_record", "loads"}
# The names the pipeline gives the typed records (dataset.json, training.json, evaluation.json,
# compression.json, export.json, plan.json and what its readers take of it: the probes and auto's
# decision, model_parallel's split) wherever it holds one; "export" is RunPaths' name for export.json.
TYPED = {"dataset", "training", "evaluation", "compression", "exported", "export", "plan", "split"}


def _names(node: ast.expr) -> str | None:
    """The last name of ``x``, ``a.b.x`` (the record a subscript or a reader is given)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def untyped_reads(files: list[Path], record_names: set[str]) -> list[str]:
    """Where a typed record is read past its model: ``dataset["key"]``, or its file read as plain JSON
    (``read_record(paths.dataset)``, ``json.loads(paths.dataset.read_text())``) other than into
    ``<Model>.model_validate``."""
    found = []
    for path in files:
        tree = ast.parse(path.read_text())
        validated = {
            id(argument)
            for call in ast.walk(tree)
            if isinstance(call, ast.Call) and _names(call.func) == "model_validate"
            for argument in call.args
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and _names(node.value) in record_names:
                if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and _names(node.func) in _READERS and id(node) not in validated:
                read = ast.unparse(node)
                if any(f".{name})" in read or f".{name}.read_text()" in read for name in record_names):
                    found.append(f"{path.name}:{node.lineno}: {read}")
    return found


def test_no_typed_record_is_read_by_string_key_or_past_its_model(tmp_path):
    files = [p for folder in ("hetflow", "dags", "plugins") for p in sorted((REPO / folder).rglob("*.py"))]
    assert len(files) > 50
    assert untyped_reads(files, TYPED) == []
    planted = tmp_path / "evaluate.py"
    planted.write_text(
        "shape = dataset['input_shape']\n"
        "record = read_record(paths.dataset)\n"
        "raw = json.loads(run_paths(r).dataset.read_text())\n"
        "kept = DatasetRecord.model_validate(read_replica_record(paths.dataset))\n"
        "ok = dataset.input_shape\n"
    )
    assert untyped_reads([planted], {"dataset"}) == [
        "evaluate.py:1: dataset['input_shape']",
        "evaluate.py:2: read_record(paths.dataset)",
        "evaluate.py:3: json.loads(run_paths(r).dataset.read_text())",
    ]


def test_every_stage_record_has_a_file_of_the_run_directory():
    for record in StageRecord.__subclasses__():
        assert getattr(RunPaths(Path("/runs/a")), record.FILE).parent == Path("/runs/a"), record.__name__


def test_a_dataset_record_is_written_and_read_back_through_run_paths_and_refuses_what_it_does_not_know(tmp_path):
    record = DatasetRecord(
        name="uci_digits",
        version="1.0.0",
        data_dir="/data",
        prepared_dir="/data/uci_digits/1.0.0",
        source_path="/data/uci_digits/1.0.0",
        reused=False,
        splits={"train": 1258, "validation": 180, "test": 359},
        shards={"train": 2, "validation": 1, "test": 1},
        input_shape=[8, 8, 1],
        num_classes=10,
        class_names=[str(d) for d in range(10)],
        fingerprint="f" * 64,
        data_changed=False,
    )
    paths = RunPaths(tmp_path)
    record.write(paths)
    assert (tmp_path / "dataset.json").exists()
    assert DatasetRecord.read(paths) == record
    (tmp_path / "dataset.json").write_text(record.model_dump_json()[:-1] + ', "num_clases": 3}')
    with pytest.raises(ValidationError, match="num_clases"):
        DatasetRecord.read(paths)


def test_a_compression_record_is_written_and_read_back_with_only_its_cases_keys(tmp_path):
    record = CompressionRecord(
        prune=True,
        quantize="int8",
        variants={
            "pruned_int8": {
                "path": "/runs/a/compressed/pruned_int8.tflite",
                "base": "pruned",
                "quantize": "int8",
                "sparsity": 0.69,
                "encoding": "sparse",
                "sparse_tensors": [{"name": "dense/MatMul", "shape": [128, 64], "block": [1, 16]}],
                "reference_validation_accuracy": 0.98,
                "post_training_validation_accuracy": 0.975,
                "int8_method": "post_training",
            }
        },
        fine_tuning_seconds=12.5,
        fine_tuning_steps=162,
        fine_tuning={
            "steps": 162,
            "max_steps": 576,
            "stopped": "recovered",
            "target_validation_accuracy": 0.975,
            "validation_accuracy": [[18, 0.9], [162, 0.98]],
        },
        trained_steps=390,
        target_sparsity=0.8,
        pruned_layers=["dense"],
        pruning_blocks={"dense": [16, 1]},
        kernel_sparsity={"dense": 0.8, "logits": 0.0},
        sparsity=0.69,
        pruned_weights="/runs/a/compressed/pruned.weights.h5",
    )
    paths = RunPaths(tmp_path)
    record.write(paths)
    assert CompressionRecord.read(paths) == record
    written = json.loads((tmp_path / "compression.json").read_text())
    assert written["fine_tuning"]["validation_accuracy"] == [[18, 0.9], [162, 0.98]]
    assert "quantization_aware_steps" not in written["variants"]["pruned_int8"]  # post-training sufficed
    # Without pruning, none of pruning's keys: not written as null.
    assert CompressionRecord(prune=False, quantize="none", variants={}).as_json() == {
        "prune": False,
        "quantize": "none",
        "variants": {},
    }
    written["variants"]["pruned_int8"]["int8_methd"] = "post_training"
    (tmp_path / "compression.json").write_text(json.dumps(written))
    with pytest.raises(ValidationError, match="int8_methd"):
        CompressionRecord.read(paths)


def test_an_export_record_is_written_and_read_back_with_only_each_artifacts_keys(tmp_path):
    scores = {"test_accuracy": 0.97, "agreement_with_float": 1.0, "max_logit_difference": 1e-6, "latency_ms": 0.5}
    record = ExportRecord(
        float_test_accuracy=0.97,
        artifacts={
            "saved_model": {
                "format": "saved_model",
                "path": "/runs/a/saved_model",
                "weights_bytes": 40_000,
                "bytes": 98_604,
                "gzip_bytes": 46_336,
                **scores,
                "accuracy_drop": 0.0,
                "accepted": True,
            },
            "tflite_float16": {
                "format": "tflite",
                "variant": "float16",
                "quantize": "float16",
                "pruned": False,
                "sparsity": 0.0,
                "encoding": "dense",
                "sparse_tensors": [],
                "int8_method": None,
                "path": "/runs/a/compressed/float16.tflite",
                "bytes": 21_344,
                "gzip_bytes": 19_020,
                **scores,
                "test_accuracy": 0.9,
                "accuracy_drop": 0.07,
                "accepted": False,
                "reason": "accuracy drop 0.0700 > max_accuracy_drop 0.01",
            },
        },
        chosen_tflite=None,
    )
    paths = RunPaths(tmp_path)
    record.write(paths)
    assert ExportRecord.read(paths) == record
    written = json.loads((tmp_path / "export.json").read_text())
    # The SavedModel has none of the TFLite keys, an accepted artifact no reason; int8_method is null but for int8.
    assert "variant" not in written["artifacts"]["saved_model"] and "reason" not in written["artifacts"]["saved_model"]
    assert written["artifacts"]["tflite_float16"]["int8_method"] is None and written["chosen_tflite"] is None
    written["artifacts"]["saved_model"]["gzip_byte"] = 1
    (tmp_path / "export.json").write_text(json.dumps(written))
    with pytest.raises(ValidationError, match="gzip_byte"):
        ExportRecord.read(paths)

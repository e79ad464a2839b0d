"""The records stages hand each other (hetflow/records.py, and training.json's TrainingRecord, which
the trust boundary's reader checks): typed, read and written through their model at the path RunPaths
gives, and never read by string key anywhere in the pipeline."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO
from pydantic import ValidationError

from hetflow.paths import RunPaths
from hetflow.records import DatasetRecord, StageRecord

_READERS = {"read_record", "read_replica_record", "loads"}
# The names the pipeline gives the typed records (dataset.json, training.json, evaluation.json)
# wherever it holds one.
TYPED = {"dataset", "training", "evaluation"}


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

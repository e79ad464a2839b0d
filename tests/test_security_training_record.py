"""training.json comes from the chief replica, so the pipeline takes it typed: what the writer writes
passes whole, and a hostile replica's record (huge strings, nested structures, NaN, negative or huge
step counts, a key of the pipeline's own, more workers or epochs than the spec has) is refused in one
line naming the file and the field, by the one reader every stage uses."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from conftest import REPO

from hetflow.paths import NotRegularFile, RunPaths, write_record
from hetflow.records import DatasetRecord
from hetflow.replica.training_json import read_training
from hetflow.spec import parse_spec

SPEC = parse_spec({"strategy": "multi_worker_mirrored", "workers": 2, "epochs": 3, "batch_size": 32})
DATASET = DatasetRecord.model_construct(splits={"train": 160, "validation": 32, "test": 32})  # 5 steps of 32 an epoch


class _Resumed:
    """Where the epoch loop starts and what it tells after each epoch: no checkpoint yet."""

    def restore(self) -> int:
        return 0

    def epoch_done(self, epochs_done: int) -> None:
        pass


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """training.json as the chief writes it: the real epoch loop run over two of the three epochs
    (stopped at the target), ``training_record``'s fields, ``write_record``."""
    from hetflow.replica.loop import EpochLoop
    from hetflow.replica.record import training_record, worker_rate

    spec = parse_spec({**SPEC.flat(), "target_accuracy": 0.5})
    loop = EpochLoop(spec, steps=5)
    accuracy = iter([0.25, 0.75])
    loop.run(loop.one_step_at_a_time(lambda: (0.5, 16.0)), lambda: (8.0, 32 * next(accuracy), 32.0), _Resumed())
    per_worker = {f"worker-{i}": {**worker_rate(16, 10, loop.train_seconds), "batch": 16} for i in range(2)}
    fields = {"per_replica_batch": 16, "balanced": False, "worker_batches": [16, 16]}
    record = training_record(spec, loop, replicas_in_sync=2, per_worker=per_worker, **fields)
    paths = RunPaths(tmp_path_factory.mktemp("run"))
    write_record(paths.training, record)
    return paths.training


def _forged(written: Path, tmp_path: Path, change) -> Path:
    """The written record with ``change`` made to it, written as a replica's json.dumps would
    (NaN and Infinity included)."""
    record = json.loads(written.read_text())
    change(record)
    forged = tmp_path / "training.json"
    forged.write_text(json.dumps(record))
    return forged


def test_the_writers_record_passes_whole(written):
    spec = parse_spec({**SPEC.flat(), "target_accuracy": 0.5})
    read = read_training(written, spec, DATASET)
    assert read.model_dump(mode="json", exclude_unset=True) == json.loads(written.read_text())


def _set(path: str, value):
    def change(record):
        *parents, last = path.split("/")
        for part in parents:
            record = record[int(part)] if isinstance(record, list) else record[part]
        record[int(last) if isinstance(record, list) else last] = value

    return change


HOSTILE = [
    ("history/loss/1", float("nan"), r"history\.loss\[1\]: Input should be a finite number"),
    ("examples_per_second", float("inf"), r"examples_per_second: Input should be a finite number"),
    ("train_seconds", 1e308, r"train_seconds: Input should be less than or equal to 10000000"),
    ("strategy", "x" * 1_000_000, r"strategy: Input should be 'one_device', "),
    ("per_worker/worker-0/steps", {"deep": [[[1]]]}, r"per_worker\.worker-0\.steps: Input should be a valid integer"),
    ("steps_per_epoch", -1, r"steps_per_epoch: Input should be greater than or equal to 1"),
    ("epochs_done", True, r"epochs_done: Input should be a valid integer"),
    ("attempt", {"id": "forged"}, r"attempt: Extra inputs are not permitted"),
    ("per_worker/worker-0/batch", "16", r"per_worker\.worker-0\.batch: Input should be a valid integer"),
    ("whole_job_breakdown/shutdown", "x" * 300, r"whole_job_breakdown\.shutdown: Input should be a valid number"),
    ("layer_placement", [{"layer": "d" * 201, "device": "cpu", "variables": []}], r"layer_placement\[0\]\.layer: "),
    ("epoch_seconds", [0.1] * 1001, r"epoch_seconds: List should have at most 1000 items"),
    # Well typed, but more than the spec trains: compress would fine-tune on the forged steps.
    ("steps_per_epoch", 100_000, r"steps_per_epoch must be 5, the spec's: refused"),
    ("epochs_done", 1000, r"epochs_done must be at most epochs \(3\)"),
    ("epochs", 1000, r"epochs must be the spec's 3"),
    ("per_worker/worker-7", {"steps": 1, "examples_per_second": 1.0, "step_seconds": 1.0}, r"per_worker must be"),
    ("per_worker/worker-1/steps", 10_000, r"per_worker\.worker-1\.steps must be at most the 10 steps trained"),
    ("history/loss", [0.1] * 999, r"history\.loss must be 2 values, one per epoch done"),
    ("worker_batches", [1, 1], r"worker_batches must be 2 shares summing to global_batch \(32\)"),
    ("strategy", "parameter_server", r"strategy must be the spec's multi_worker_mirrored"),
]


@pytest.mark.parametrize(("field", "value", "refusal"), HOSTILE, ids=[f"{f}={str(v)[:12]}" for f, v, _ in HOSTILE])
def test_a_hostile_record_is_refused_in_one_line_naming_the_field(written, tmp_path, field, value, refusal):
    spec = parse_spec({**SPEC.flat(), "target_accuracy": 0.5})
    forged = _forged(written, tmp_path, _set(field, value))
    with pytest.raises(NotRegularFile, match=refusal) as refused:
        read_training(forged, spec, DATASET)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{forged}: ") and len(message) < 300, message


def test_the_steps_are_those_the_replicas_plan(written):
    """planned_steps, which bounds what compress fine-tunes on, agrees with the replicas' own count."""
    from hetflow.models.schedule import steps_per_epoch
    from hetflow.replica import parameter_server
    from hetflow.replica.training_json import PS_STEPS_PER_CLOSURE, planned_steps

    assert PS_STEPS_PER_CLOSURE == parameter_server.STEPS_PER_CLOSURE
    for values in ({}, {"steps_per_epoch": 7}, {"batch_size": 1000}):
        spec = parse_spec({**SPEC.flat(), **values})
        assert planned_steps(spec, DATASET) == steps_per_epoch(spec, DATASET)
    ps = parse_spec({**SPEC.flat(), "strategy": "parameter_server", "ps": 1, "steps_per_epoch": 7})
    assert planned_steps(ps, DATASET) == 10


def _reads_training_untyped(path: Path) -> list[str]:
    """Calls in ``path`` that read training.json other than through ``read_training``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in (
            "read_replica_record",
            "read_record",
        ):
            if any(ast.unparse(arg).endswith(".training") for arg in node.args):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_every_stage_reads_training_json_typed():
    modules = sorted((REPO / "hetflow").rglob("*.py"))
    assert [hit for module in modules for hit in _reads_training_untyped(module)] == []

"""Runs at the same moment, in real processes: nothing they share is lost or half-written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, wait_for

# Waits for a start signal (the file argv[2]) after the slow imports, so that the processes really
# prepare at the same moment; prints what prepare_dataset returned.
_PREPARE = """
import json, os, sys, time
from pathlib import Path
from hetflow.data.prepare import prepare_dataset
import tensorflow_datasets  # noqa: F401
data_dir, go, ready = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
while not go.exists():
    time.sleep(0.01)
print(prepare_dataset("uci_digits", data_dir).model_dump_json())
"""


def _started_together(script: str, args: list[list[str]], tmp_path: Path) -> list[subprocess.CompletedProcess]:
    """Start one process per argument list, release them at once, and wait for them all."""
    go = tmp_path / "go"
    ready = [tmp_path / f"ready-{i}" for i in range(len(args))]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, *extra, str(go), str(flag)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for extra, flag in zip(args, ready)
    ]
    assert wait_for(lambda: all(flag.exists() for flag in ready), timeout=120)
    go.touch()
    done = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return done


def test_two_first_preparations_of_one_dataset_both_succeed_with_one_copy(tmp_path):
    data_dir = tmp_path / "data"
    done = _started_together(_PREPARE, [[str(data_dir)], [str(data_dir)]], tmp_path)
    for process in done:
        assert process.returncode == 0, process.stderr[-3000:]
    records = [json.loads(process.stdout.strip().splitlines()[-1]) for process in done]
    # One process prepared it, the other waited and re-used that copy.
    assert sorted(record["reused"] for record in records) == [False, True]
    assert records[0]["fingerprint"] == records[1]["fingerprint"]
    assert sorted(p.name for p in (data_dir / "uci_digits").iterdir()) == ["1.0.0"]  # no second, half copy
    assert len(list((data_dir / "uci_digits" / "1.0.0").glob("*.tfrecord-*"))) == 12
    index = json.loads((data_dir / "hetflow_fingerprints.json").read_text())
    assert index == {"uci_digits": records[0]["fingerprint"]}


# Records 40 datasets' fingerprints, one after another, in the shared index.
_RECORD_FINGERPRINTS = """
import sys, time
from pathlib import Path
from hetflow.data.prepare import fingerprint_changed
data_dir, writer, go, ready = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
ready.touch()
while not go.exists():
    time.sleep(0.01)
for n in range(40):
    fingerprint_changed(data_dir, f"{writer}-{n}", f"fingerprint-{writer}-{n}")
"""


def test_fingerprints_recorded_at_once_are_all_kept(tmp_path):
    writers = ["a", "b", "c", "d"]
    done = _started_together(_RECORD_FINGERPRINTS, [[str(tmp_path), writer] for writer in writers], tmp_path)
    for process in done:
        assert process.returncode == 0, process.stderr[-3000:]
    index = json.loads((tmp_path / "hetflow_fingerprints.json").read_text())
    assert index == {f"{w}-{n}": f"fingerprint-{w}-{n}" for w in writers for n in range(40)}


# Rewrites one record again and again, each version a complete JSON object of ~300 KB.
_REWRITE = """
import sys
from pathlib import Path
from hetflow.paths import write_record
path = Path(sys.argv[1])
for version in range(150):
    write_record(path, {"version": version, "history": [version] * 60_000})
"""


def test_a_record_being_rewritten_is_never_read_half_written(tmp_path):
    from hetflow.paths import write_record

    record = tmp_path / "training.json"
    write_record(record, {"version": -1, "history": []})
    writer = subprocess.Popen([sys.executable, "-c", _REWRITE, str(record)], cwd=REPO, stderr=subprocess.PIPE)
    versions = []
    while writer.poll() is None:
        value = json.loads(record.read_text())  # a half-written file raises here
        assert value["history"] == [value["version"]] * len(value["history"])
        versions.append(value["version"])
        time.sleep(0.001)
    assert writer.returncode == 0, writer.stderr.read()
    assert json.loads(record.read_text())["version"] == 149
    assert len(set(versions)) > 5  # the reader did see the record change under it
    assert [p.name for p in tmp_path.iterdir()] == ["training.json"]  # no temporary file left


# Creates Airflow's metadata DB as `hetflow run` does first, released at once with another.
_ENSURE_AIRFLOW_DB = """
import os, sys, time
from pathlib import Path
os.environ["AIRFLOW_HOME"] = sys.argv[1]
from hetflow.cli.dag_run import ensure_airflow_db
go, ready = Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
while not go.exists():
    time.sleep(0.01)
ensure_airflow_db()
print("ready")
"""


def test_two_first_runs_on_an_empty_home_both_get_a_migrated_airflow_db(tmp_path):
    """Two `hetflow run` started together on a home with nothing yet: one migration, both succeed
    (before the lock, one died in `airflow db migrate` with "table team already exists")."""
    import sqlite3

    home = tmp_path / "airflow"
    done = _started_together(_ENSURE_AIRFLOW_DB, [[str(home)], [str(home)]], tmp_path)
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-2000:] for d in done]
    assert [d.stdout.strip().splitlines()[-1] for d in done] == ["ready", "ready"]
    assert sum("creating the Airflow metadata DB" in d.stdout for d in done) == 1
    with sqlite3.connect(home / "airflow.db") as db:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"dag_run", "task_instance", "alembic_version"} <= tables


# The smallest run that goes through every stage, each time (no skip for an unchanged spec).
_TINY = ["epochs=1", "steps_per_epoch=2", "prune=false", "quantize=none", 'export_formats=["saved_model"]']
_TINY += ["skip_unchanged=false"]


@pytest.mark.slow
def test_two_first_hetflow_runs_on_an_empty_home_both_succeed(tmp_path):
    """Two `hetflow run` started together on a home and registry with nothing yet both succeed (before
    the DAG sync's lock, one died in Airflow's DAG sync with "UNIQUE constraint failed: dag.dag_id"
    in every round of three tried: one round catches it)."""
    home = tmp_path / "home"
    (home / "mlflow").mkdir(parents=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("AIRFLOW")}
    env |= {"HETFLOW_HOME": str(home), "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"}
    sets = [arg for assignment in _TINY for arg in ("--set", assignment)]
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "hetflow.cli.main", "run", *sets],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=900)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [output[-3000:] for output in outputs]
    summaries = [json.loads(Path(output.strip().splitlines()[-1]).read_text()) for output in outputs]
    assert [summary["status"] for summary in summaries] == ["success", "success"]
    assert summaries[0]["run_id"] != summaries[1]["run_id"]

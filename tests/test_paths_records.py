"""Run directories and stage records: one directory per run id, and records that say which attempt
wrote them, so that a failed re-run is never reported as a success."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NO_COMPRESSION, REPO

AIRFLOW_RUN_ID = "manual__2026-11-22T00:12:03.120579+00:00"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A HETFLOW_HOME of the test's own (its own data dir too: a test here corrupts a shard)."""
    monkeypatch.setenv("HETFLOW_HOME", str(tmp_path))
    return tmp_path


def test_run_ids_that_read_alike_get_directories_of_their_own(home):
    from hetflow.paths import create_run_dir

    roots = {run_id: create_run_dir(run_id).root for run_id in ("x:1", "x+1", "x_1")}
    assert len(set(roots.values())) == 3
    for run_id, root in roots.items():
        assert root.parent == home / "runs"
        assert re.fullmatch(r"x_1-[0-9a-f]{12}", root.name), root.name  # readable, then a short hash
        assert (root / "run_id").read_text() == run_id
    airflow_dir = create_run_dir(AIRFLOW_RUN_ID).root.name
    assert re.fullmatch(r"manual__2026-11-22T00_12_03\.120579_00_00-[0-9a-f]{12}", airflow_dir)


def test_two_hetflow_trains_started_in_one_second_get_directories_of_their_own(home):
    """`hetflow train` names its run itself; the bench starts two at once (two_apart)."""
    from hetflow.cli.main import train_run_id
    from hetflow.paths import create_run_dir

    first, second = train_run_id(), train_run_id()
    assert re.fullmatch(r"train__\d{8}T\d{6}_[0-9a-f]{8}", first)  # readable: the start time first
    assert create_run_dir(first).root != create_run_dir(second).root


def test_another_process_finds_the_same_directory(home):
    """A retried task runs in a new process: the name must not depend on the process (no hash())."""
    from hetflow.paths import run_paths

    found = subprocess.run(
        [sys.executable, "-c", f"from hetflow.paths import run_paths; print(run_paths({AIRFLOW_RUN_ID!r}).root)"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(found.stdout.strip()) == run_paths(AIRFLOW_RUN_ID).root


def test_a_directory_that_belongs_to_another_run_id_is_refused(home):
    from hetflow.paths import RunDirectoryTaken, run_paths
    from hetflow.tasks.summarize import summarize
    from hetflow.tasks.validate_spec import validate_spec

    validate_spec({"epochs": 3}, "team-a")
    paths = run_paths("team-a")
    # What a clash of names would leave: the directory records another run's id.
    paths.owner.write_text("team-b")
    with pytest.raises(RunDirectoryTaken) as refused:
        validate_spec({"epochs": 5}, "team-a")
    assert str(refused.value) == f"run directory {paths.root} belongs to run 'team-b', not to run 'team-a'"
    assert json.loads(paths.spec.read_text())["training"]["epochs"] == 3  # the other run's record is untouched
    with pytest.raises(RunDirectoryTaken):
        summarize("team-a")
    assert not paths.summary.exists()


def test_a_retry_reuses_its_own_directory(home):
    from hetflow.paths import run_paths
    from hetflow.tasks.validate_spec import validate_spec

    validate_spec({"epochs": 3}, "retried", try_number=1)
    validate_spec({"epochs": 4}, "retried", try_number=2)
    paths = run_paths("retried")
    assert json.loads(paths.spec.read_text())["training"]["epochs"] == 4
    assert json.loads(paths.attempt("validate_spec").read_text())["try_number"] == 2


def test_an_empty_run_id_is_refused_naming_the_field(home):
    from hetflow.paths import run_paths

    with pytest.raises(ValueError, match=r"^run_id='' is invalid: expected a non-empty string$"):
        run_paths("")


@pytest.fixture
def prepared_run(home):
    """validate_spec and prepare_data, for real, as try 1 of run ``rerun``; what they returned."""
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.validate_spec import validate_spec

    returned = {
        "validate_spec": validate_spec({"epochs": 2}, "rerun", try_number=1),
        "prepare_data": prepare_data("rerun", try_number=1),
    }
    return returned


def test_every_record_names_the_attempt_that_wrote_it(prepared_run):
    from hetflow.paths import run_paths

    paths = run_paths("rerun")
    for stage, record in (("validate_spec", paths.spec), ("prepare_data", paths.dataset)):
        assert record.exists()
        receipt = json.loads(paths.attempt(stage).read_text())
        assert (receipt["stage"], receipt["run_id"], receipt["try_number"]) == (stage, "rerun", 1)
        assert re.fullmatch(r"[0-9a-f]{32}", receipt["id"])
        assert prepared_run[stage]["attempt"]["id"] == receipt["id"]  # what Airflow keeps as the XCom
    ids = {json.loads(paths.attempt(stage).read_text())["id"] for stage in ("validate_spec", "prepare_data")}
    assert len(ids) == 2


def test_a_stage_that_starts_removes_its_own_and_later_records(prepared_run, home):
    from hetflow.paths import run_paths
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.summarize import summarize

    paths = run_paths("rerun")
    paths.output.mkdir()  # as provisioning makes it
    # An earlier attempt got further: its records of later stages, with their receipts, are there.
    for stage, record in (("train", paths.training), ("evaluate", paths.evaluation)):
        record.write_text(json.dumps({"test_accuracy": 0.97, "train_seconds": 12.0}))
        paths.attempt(stage).write_text(json.dumps({"stage": stage, "run_id": "rerun", "id": "earlier"}))
    paths.summary.write_text(json.dumps({"status": "success"}))
    # Try 2 of prepare_data fails: a shard changed since it was prepared.
    shard = sorted((home / "data" / "uci_digits" / "1.0.0").glob("uci_digits-test.tfrecord-*"))[0]
    shard.write_bytes(shard.read_bytes()[:-50])
    with pytest.raises(ValueError, match=rf"data shard {shard}"):
        prepare_data("rerun", try_number=2)
    left = sorted(str(p.relative_to(paths.root)) for p in paths.root.rglob("*") if p.is_file())
    assert left == ["attempts/validate_spec.json", "run_id", "spec.json"]
    with pytest.raises(RuntimeError, match=r"^run rerun failed at stage prepare_data; summary: "):
        summarize("rerun")
    summary = json.loads(paths.summary.read_text())
    assert (summary["status"], summary["failed_stage"]) == ("failed", "prepare_data")
    assert summary["metrics"]["test_accuracy"] is None and summary["metrics"]["train_seconds"] is None
    assert list(summary["attempts"]) == ["validate_spec"]


def test_summarize_fails_a_stage_whose_last_try_failed_whatever_files_are_left(prepared_run):
    """Airflow holds a task's return value only for its last try, and only if that try succeeded:
    a try that failed before it could remove anything (killed while starting) leaves the earlier
    attempt's record and receipt, and the run still fails at that stage."""
    from hetflow.paths import run_paths
    from hetflow.tasks.summarize import summarize

    paths = run_paths("rerun")
    earlier = prepared_run["prepare_data"]
    for returned_by_prepare in (None, {**earlier, "attempt": {**earlier["attempt"], "id": "0" * 32}}):
        returned = {"validate_spec": prepared_run["validate_spec"], "prepare_data": returned_by_prepare}
        with pytest.raises(RuntimeError, match=r"failed at stage prepare_data"):
            summarize("rerun", returned)
        summary = json.loads(paths.summary.read_text())
        assert (summary["failed_stage"], summary["dataset"]["fingerprint"]) == ("prepare_data", None)
        assert paths.dataset.exists() and paths.attempt("prepare_data").exists()
    # What Airflow returned matches the receipts: the run goes on to fail where records stop.
    with pytest.raises(RuntimeError, match=r"failed at stage provision_cluster"):
        summarize("rerun", prepared_run)
    summary = json.loads(paths.summary.read_text())
    assert summary["dataset"]["fingerprint"] == json.loads(paths.dataset.read_text())["fingerprint"]
    assert summary["attempts"]["prepare_data"]["try_number"] == 1


def test_a_training_done_before_is_skipped_with_the_reason_prepare_data_recorded(prepared_run, home, monkeypatch):
    """prepare_data finds a version trained with this run's training key by another Airflow run: its
    record says why the run skips, and summary.json reports that sentence (summarize reads it from
    the record, not from prepare_data's code)."""
    from hetflow.paths import run_paths
    from hetflow.records import DatasetRecord
    from hetflow.registry.training_key import TRAINING_KEY_TAG
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.summarize import summarize
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
    paths = run_paths("rerun")
    dataset = DatasetRecord.read(paths)
    client = MlflowClient()
    model = json.loads(paths.spec.read_text())["registry"]["model_name"]
    client.create_registered_model(model)
    client.create_model_version(
        model, source=str(home), tags={TRAINING_KEY_TAG: dataset.training_key, "airflow.run_id": "earlier"}
    )
    returned = {"validate_spec": prepared_run["validate_spec"], "prepare_data": prepare_data("rerun", try_number=2)}
    record = json.loads(paths.dataset.read_text())
    assert record["trained_before"]["airflow_run_id"] == "earlier"
    reason = (
        f"{model} v1 was trained from this spec on data with fingerprint {dataset.fingerprint[:12]} by Airflow "
        "run earlier: nothing to train or register (skip_unchanged=false trains again)"
    )
    assert record["skip_reason"] == reason
    record["skip_reason"] = "as prepare_data wrote it"
    paths.dataset.write_text(json.dumps(record))
    summary = summarize("rerun", returned)
    assert (summary["status"], summary["failed_stage"]) == ("skipped", None)
    assert summary["skipped_because"] == "as prepare_data wrote it"
    assert summary["registry"]["version"] == 1


def test_later_stages_refuse_a_training_record_linked_out_of_the_run_directory(prepared_run, home, caplog):
    """Replicas write the run directory's top: a training.json planted as a link to a JSON object
    elsewhere (here the stack's secrets) is refused by the stages that read it, in one line naming
    it, and nothing of what it points at is reported."""
    import logging

    from hetflow.paths import NotRegularFile, run_paths
    from hetflow.tasks.compress import compress
    from hetflow.tasks.summarize import summarize

    paths = run_paths("rerun")
    secret = home / "stack" / "secrets.json"
    secret.parent.mkdir()
    secret.write_text(json.dumps({"password": "secret", "train_seconds": 1.0}))
    paths.cluster.write_text(json.dumps({"replicas": []}))
    for stage in ("provision_cluster", "train"):
        paths.attempt(stage).write_text(json.dumps({"stage": stage, "run_id": "rerun", "id": stage}))
    paths.output.mkdir()  # as provisioning makes it
    paths.training.symlink_to(secret)
    refused = f"{paths.training} is a symbolic link: refused (the pipeline reads regular files only)"
    for stage in (summarize, compress):
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="hetflow.stages"), pytest.raises(NotRegularFile) as caught:
            stage("rerun")
        assert str(caught.value) == refused
        assert [r.getMessage() for r in caplog.records] == [f"{stage.__name__} failed: NotRegularFile: {refused}"]
    assert not paths.summary.exists()


_DAG_TEST = """
import json, sys
from datetime import datetime, timezone

from hetflow.cli.dag_run import DAG_ID, ensure_airflow_db
from hetflow.paths import REPO_ROOT

ensure_airflow_db()
from airflow.dag_processing.dagbag import DagBag

# One logical date for both: dag.test then replaces the DAG run, and the run id is the same.
when = datetime(2026, 1, 1, tzinfo=timezone.utc)
run = DagBag(dag_folder=str(REPO_ROOT / "dags")).get_dag(DAG_ID).test(
    logical_date=when, run_after=when, run_conf=json.loads(sys.argv[1])
)
print(json.dumps({"run_id": run.run_id, "state": str(run.state)}))
"""


def _dag_test(env, conf: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _DAG_TEST, json.dumps(conf)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.heavy  # a second DAG run of a failing train; make test fails one once (test_e2e_run)
@pytest.mark.slow
def test_a_rerun_of_the_dag_whose_train_fails_ends_failed(hetflow_env):
    from hetflow.paths import run_paths
    from hetflow.spec import parse_assignment

    no_compression = dict(parse_assignment(assignment) for assignment in NO_COMPRESSION)
    first = _dag_test(hetflow_env, {"epochs": 2, "registered_model": "rerun-digits", **no_compression})
    assert first["state"] == "success"
    paths = run_paths(first["run_id"])
    assert json.loads(paths.summary.read_text())["status"] == "success"
    # The same run again, as after a Clear; this time training runs out of time.
    second = _dag_test(hetflow_env, {"epochs": 1000, "train_timeout_seconds": 10, "registered_model": "rerun-digits"})
    assert second == {"run_id": first["run_id"], "state": "failed"}
    summary = json.loads(paths.summary.read_text())
    assert (summary["status"], summary["failed_stage"]) == ("failed", "train")
    assert summary["metrics"]["test_accuracy"] is None and summary["registry"] is None
    assert not paths.training.exists() and not paths.registry.exists()
    assert summary["attempts"]["validate_spec"]["run_id"] == first["run_id"]

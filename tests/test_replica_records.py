"""What a replica writes is data, and the pipeline's own records are out of its reach: a hostile
process in a replica's sandbox tries to rewrite cluster.json, dataset.json and its keeper's pid
file, and plants links and a fifo where stages read and write; the run keeps its records, the
supervisor's detach removes what was planted (each named in a warning), and uploads to MLflow take
regular files only. Real replicas, real sandboxes, a real MLflow store."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import ATTEMPT, wait_for

from hetflow.paths import NotRegularFile, hetflow_home, read_replica_record, run_paths, write_record

_HOSTILE = ATTEMPT + textwrap.dedent(
    """
    import json, os, sys
    paths = json.loads(sys.argv[1])
    def rewrite(path, text):
        with open(path, "w") as handle:
            handle.write(text)
    def swap(path, text):  # the way around a file it may not write: a new one renamed over it
        rewrite(path + ".new", text)
        os.replace(path + ".new", path)
    forged = json.dumps({"network_isolation": {"isolated": False}, "file_isolation": {"confined": False}})
    attempt("rewrite-cluster", lambda: rewrite(paths["cluster"], forged))
    attempt("swap-cluster", lambda: swap(paths["cluster"], forged))
    attempt("swap-dataset", lambda: swap(paths["dataset"], json.dumps({"prepared_dir": "/"})))
    attempt("rewrite-pid", lambda: rewrite(paths["pid"], "1"))
    attempt("plant-log", lambda: os.symlink(paths["secret"], paths["log"]))
    attempt("plant-plot", lambda: os.symlink(paths["secret"], paths["plot"]))
    attempt("plant-training", lambda: os.symlink(paths["secret"], paths["training"]))
    attempt("plant-evaluation", lambda: os.symlink(paths["victim"], paths["evaluation"]))
    attempt("plant-summary", lambda: os.mkfifo(paths["summary"]))
    attempt("plant-fifo", lambda: os.mkfifo(paths["plan"]))
    """
)


@pytest.mark.replicas
def test_a_replica_that_plants_links_and_rewrites_records_steers_nothing(provisioned, caplog, tmp_path):
    from hetflow.cluster.backends.local import keeper
    from hetflow.cluster.backends.local.replicas import LocalReplicas, file_view
    from hetflow.cluster.layout import ClusterLayout
    from hetflow.cluster.processes import run_replicas
    from hetflow.pipeline.attempts import load_spec

    secret = hetflow_home() / "stack" / "secrets.json"
    secret.parent.mkdir(exist_ok=True)
    secret.write_text('{"password": "secret"}')
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    run_id = provisioned(strategy="multi_worker_mirrored", workers=2)
    paths = run_paths(run_id)
    assert wait_for(lambda: len(run_replicas(run_id)) == 2, timeout=60)
    records = {path: path.read_bytes() for path in (paths.cluster, paths.dataset, paths.replicas / "worker-0.pid")}
    targets = {
        "cluster": str(paths.cluster),
        "dataset": str(paths.dataset),
        "pid": str(paths.replicas / "worker-0.pid"),
        "secret": str(secret),
        "victim": str(victim),
        "log": str(paths.logs / "planted.log"),
        "plot": str(paths.plots / "planted.png"),
        "training": str(paths.training),
        "plan": str(paths.plan),
        "evaluation": str(paths.evaluation),
        "summary": str(paths.summary),
    }
    view = file_view(load_spec(paths), paths.root)
    box = keeper.replica_sandbox(keeper.View(view["read_write"], view["read_only"], view["hidden"]), paths.root)
    try:
        command = box.command([sys.executable, "-c", _HOSTILE, json.dumps(targets)])
        done = subprocess.run(command, pass_fds=box.fds, capture_output=True, text=True, timeout=60)
    finally:
        box.close()
    assert done.returncode == 0, done.stderr
    seen = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    refused = ("rewrite-cluster", "swap-cluster", "swap-dataset", "rewrite-pid", "plant-log", "plant-plot")
    for attack in (*refused, "plant-evaluation", "plant-summary"):
        assert seen[attack] != "ok", f"{attack}: {seen[attack]}"
    assert {path: path.read_bytes() for path in records} == records  # the pipeline's records are whole
    # What it could plant (its output folder is where it writes): a link and a fifo at the names of
    # records it writes and the pipeline reads.
    assert seen["plant-training"] == seen["plant-fifo"] == "ok"

    # The supervisor's detach (the train task's end) removes them, naming each.
    layout = ClusterLayout.from_dict(json.loads(paths.cluster.read_text()))
    supervisor = LocalReplicas(layout, load_spec(paths), paths.root)
    supervisor.attach()
    with caplog.at_level(logging.WARNING, logger="hetflow.cluster"):
        supervisor.detach()
    for planted in (paths.training, paths.plan):
        assert not os.path.lexists(planted)
        assert f"removed {planted}, which a replica left" in caplog.text
    assert run_replicas(run_id) == {}  # detach stopped the run
    write_record(paths.evaluation, {"test_accuracy": 1.0})
    assert victim.read_text() == "untouched" and json.loads(paths.evaluation.read_text()) == {"test_accuracy": 1.0}


def test_a_replica_record_is_read_as_data(tmp_path):
    record = tmp_path / "training.json"
    record.write_text('{"epochs": 2}')
    assert read_replica_record(record) == {"epochs": 2}
    link = tmp_path / "link.json"
    link.symlink_to(record)
    with pytest.raises(NotRegularFile, match=r"link\.json is a symbolic link: refused"):
        read_replica_record(link)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(NotRegularFile, match=r"list\.json holds a JSON list, not an object"):
        read_replica_record(tmp_path / "list.json")
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as handle:
        handle.truncate((16 << 20) + 1)
    with pytest.raises(NotRegularFile, match=r"huge\.json holds 16777217 bytes, more than the 16777216 allowed"):
        read_replica_record(huge)
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(NotRegularFile, match=r"fifo\.json is not a regular file"):
        read_replica_record(tmp_path / "fifo.json")


def test_uploads_to_mlflow_take_regular_files_only(hetflow_env, tmp_path, caplog):
    from hetflow.registry.run_record import upload_regular_files
    from mlflow import MlflowClient

    secret = tmp_path / "secrets.json"
    secret.write_text('{"password": "secret"}')
    logs = tmp_path / "logs"
    (logs / "nested").mkdir(parents=True)
    (logs / "worker-0.log").write_text("epoch 1")
    (logs / "nested" / "worker-1.log").write_text("epoch 2")
    (logs / "planted.log").symlink_to(secret)
    (logs / "planted-dir").symlink_to(tmp_path)
    client = MlflowClient(hetflow_env["MLFLOW_TRACKING_URI"])
    # An artifact root of the test's own: a sqlite store's default one is ./mlruns in the working directory.
    experiment_id = client.create_experiment("uploads", artifact_location=(tmp_path / "artifacts").as_uri())
    experiment = client.get_experiment(experiment_id)
    run = client.create_run(experiment.experiment_id)
    with caplog.at_level(logging.WARNING, logger="hetflow.registry"):
        uploaded = upload_regular_files(client, run.info.run_id, [logs, secret.parent / "missing.json"], "logs")
    assert uploaded == ["nested/worker-1.log", "worker-0.log"]
    listed = {a.path for a in client.list_artifacts(run.info.run_id, "logs")}
    listed |= {a.path for a in client.list_artifacts(run.info.run_id, "logs/nested")}
    assert listed == {"logs/nested", "logs/nested/worker-1.log", "logs/worker-0.log"}
    assert "planted.log is a symbolic link: refused" in caplog.text
    assert "planted-dir is a symbolic link: refused" in caplog.text

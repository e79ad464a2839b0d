"""Bad input and broken surroundings: each fails with one clear line, and nothing produced is lost."""

from __future__ import annotations

import json
import os
import socket

import pytest

from hetflow.spec import SpecError, parse_spec


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"restart_policy": "sometimes"}, 'restart_policy="sometimes" is invalid: expected one of never, on_failure'),
        ({"backoff_limit": -1}, "backoff_limit=-1 is invalid"),
        ({"checkpoint_every": 0}, "checkpoint_every=0 is invalid: expected an integer >= 1 and <= 1000"),
        (
            {"backend": "kubernetes", "restart_policy": "exit_code"},
            "restart_policy=exit_code is invalid with backend=kubernetes: expected never or on_failure",
        ),
    ],
)
def test_restart_keys_are_validated(values, message):
    with pytest.raises(SpecError) as caught:
        parse_spec(values)
    assert caught.value.problems[0].startswith(message)


def test_a_data_dir_that_is_not_writable_is_named(tmp_path):
    from hetflow.data.prepare import prepare_dataset

    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    with pytest.raises(ValueError, match=rf"data dir {blocked}/data is not writable .*set HETFLOW_HOME"):
        prepare_dataset("uci_digits", blocked / "data")


def test_a_tfds_dataset_that_cannot_be_had_offline_is_refused_before_the_run_starts(tmp_path, monkeypatch):
    """Offline, a TFDS dataset not prepared in data_dir fails validate_spec in one line naming the
    dataset, the data dir and how to prepare it; an unknown name lists the offline datasets."""
    from hetflow.data import prepare
    from hetflow.tasks.validate_spec import validate_spec

    # Where TFDS would download from: a port nothing listens on, as on a machine without network.
    monkeypatch.setattr(prepare, "_DOWNLOAD_HOST", ("127.0.0.1", _free_port()))
    monkeypatch.setenv("HETFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HETFLOW_DATA_ROOTS", str(tmp_path))  # a data_dir outside HETFLOW_HOME, as an operator allows
    data_dir = tmp_path / "tfds"
    with pytest.raises(SpecError) as caught:
        validate_spec({"dataset": "mnist", "data_dir": str(data_dir)}, "offline-run")
    [problem] = caught.value.problems
    assert problem.startswith(f"dataset=mnist is not prepared in data_dir {data_dir} and 127.0.0.1 is unreachable")
    assert f"`tfds build mnist --data_dir DIR`) and copy DIR's contents into {data_dir}" in problem
    with pytest.raises(SpecError, match="dataset='no_such_set' is not a TFDS dataset; offline datasets: uci_digits"):
        validate_spec({"dataset": "no_such_set"}, "offline-run")
    assert not (tmp_path / "home" / "runs").exists()  # refused before a run directory was made


def test_a_truncated_shard_is_named_and_the_rest_kept(tmp_path):
    from hetflow.data.prepare import prepare_dataset

    prepare_dataset("uci_digits", tmp_path)
    version_dir = tmp_path / "uci_digits" / "1.0.0"
    shard = sorted(version_dir.glob("uci_digits-train.tfrecord-*"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"corrupt or truncated data shard {shard} .*delete {version_dir}"):
        prepare_dataset("uci_digits", tmp_path)
    assert len(list(version_dir.glob("*.tfrecord-*"))) == 12  # nothing deleted behind the user's back


def test_a_taken_port_moves_the_replica_and_every_tf_config_follows(tmp_path):
    from hetflow.cluster.backends.local.replicas import LocalReplicas, port_taken
    from hetflow.cluster.layout import plan_cluster

    spec = parse_spec({"strategy": "multi_worker_mirrored", "workers": 2})
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        layout = plan_cluster(spec, "port-run", pick_port=iter([taken, _free_port()]).__next__)
        cluster = LocalReplicas(layout, spec, tmp_path)
        assert port_taken(taken)
        cluster._move_off_taken_ports()
    moved = cluster.layout.replicas[0].address
    assert moved != f"127.0.0.1:{taken}" and cluster.layout.replicas[1] == layout.replicas[1]
    assert json.loads(cluster.layout.tf_config(cluster.layout.replicas[1]))["cluster"]["worker"][0] == moved
    assert json.loads((tmp_path / "cluster.json").read_text())["replicas"][0]["address"] == moved


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_mlflow_unreachable_fails_register_clearly_and_a_retry_registers(hetflow_env, monkeypatch):
    from hetflow.paths import run_paths
    from hetflow.tasks.compress import compress
    from hetflow.tasks.evaluate import evaluate
    from hetflow.tasks.export import export
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.provision_cluster import provision_cluster
    from hetflow.tasks.register import TrackingUnavailable, register
    from hetflow.tasks.teardown_cluster import teardown_cluster
    from hetflow.tasks.train import train
    from hetflow.tasks.validate_spec import validate_spec

    run_id = f"unreachable_{os.getpid()}"
    validate_spec({"epochs": 2, "registered_model": "unreachable-digits"}, run_id)
    for stage in (
        prepare_data,
        provision_cluster,
        train,
        evaluate,
        compress,
        export,
    ):
        stage(run_id)
    teardown_cluster(run_id)
    store = hetflow_env["MLFLOW_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    with pytest.raises(TrackingUnavailable, match=r"MLflow at http://127.0.0.1:\d+ failed: .*retry the register task"):
        register(run_id, "hetflow_train")
    paths = run_paths(run_id)
    assert paths.model.exists() and paths.export.exists() and not paths.registry.exists()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert register(run_id, "hetflow_train")["version"] == 1

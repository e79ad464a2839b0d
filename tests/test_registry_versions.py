"""register_version creates the version before its files are logged (their metadata says its number):
a try that failed while saving leaves a version whose logged model is not READY, and the next try
finishes that same version instead of making another or handing back one without files."""

from __future__ import annotations

from pathlib import Path

import pytest


def _saver(payload: bytes, fail: bool = False):
    def save(path: Path, mlflow_model, registered_version: str) -> dict[str, str]:
        if fail:
            raise OSError("disk full")
        path.mkdir(parents=True)
        (path / "weights.bin").write_bytes(payload + registered_version.encode())
        mlflow_model.save(str(path / "MLmodel"))
        return {"saved_as": registered_version}

    return save


def test_a_failed_save_is_finished_by_the_next_try_as_the_same_version(tmp_path):
    from mlflow.entities import LoggedModelStatus

    import mlflow
    from hetflow.registry import store, versions

    client = store.client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("retry", artifact_location=(tmp_path / "a").as_uri())
    run = client.create_run(experiment)

    def logged_statuses():
        return [model.status for model in client.search_logged_models([experiment])]

    versions.own_registered_model(client, "retried", "retried")
    with pytest.raises(OSError, match="disk full"):
        versions.register_version(client, "retried", run.info.run_id, "model", _saver(b"w", fail=True))
    [left] = client.search_model_versions("name='retried'")
    assert logged_statuses() == [LoggedModelStatus.FAILED]

    version = versions.register_version(client, "retried", run.info.run_id, "model", _saver(b"w"))
    assert (version.version, version.tags["saved_as"]) == (left.version, "1")
    assert logged_statuses() == [LoggedModelStatus.READY]  # the same logged model, finished
    copy = mlflow.artifacts.download_artifacts(
        f"{version.source}/weights.bin", dst_path=str(tmp_path / "copy"), tracking_uri=client.tracking_uri
    )
    assert Path(copy).read_bytes() == b"w1"  # the files carry the number they were registered as
    # A third try finds it READY and re-uses it as it is.
    again = versions.register_version(client, "retried", run.info.run_id, "model", _saver(b"other"))
    assert again.version == version.version and len(client.search_model_versions("name='retried'")) == 1

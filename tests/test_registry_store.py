"""hetflow.registry.store and versions: every client names its store, so that a model is logged and
registered in one thread while another copies a version out of the registry, with nothing set in the
environment (the path `make run` takes), and neither ever reaches MLflow's default store."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hetflow.registry import store, versions
from hetflow.serving.server import ModelServer

ROUNDS = 12


def _saver(payload: bytes):
    """Writes a model folder whose one data file is ``payload`` (nothing here serves it: the copy is
    what is checked)."""

    def save(path: Path, mlflow_model, registered_version: str) -> dict[str, str]:
        path.mkdir(parents=True)
        (path / "weights.bin").write_bytes(payload)
        mlflow_model.save(str(path / "MLmodel"))
        return {}

    return save


@pytest.fixture
def bare_environment(tmp_path, monkeypatch) -> Path:
    """No MLflow variable set, and a working directory of its own, where MLflow's default store
    (``mlflow.db``, ``mlruns/``) would appear."""
    for variable in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        monkeypatch.delenv(variable, raising=False)
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    return workdir


def test_versions_logged_while_others_are_copied_out_are_all_found_in_the_named_store(bare_environment, tmp_path):
    """On the code before store.client, the served check's copy of a version looked in MLflow's default
    store whenever it did not fall inside another thread's log_model ("Registered Model with
    name=... not found"), and created mlflow.db in the working directory."""
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    client = store.client(uri)
    experiment_id = store.ensure_experiment(client)
    versions.own_registered_model(client, "raced", "raced")

    def copy_out(version: int) -> bytes:
        server = ModelServer(f"models:/raced/{version}", uri, tmp_path / "logs" / f"v{version}.log")
        try:
            return (server._download() / "weights.bin").read_bytes()
        finally:
            server.stop()

    copies = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for round_ in range(ROUNDS):
            payload = f"round {round_}".encode()
            # A run registers each version once (a retry re-uses it): one run per round.
            run_id = client.create_run(experiment_id).info.run_id
            version = versions.register_version(client, "raced", run_id, "model", _saver(payload))
            copies.append((payload, pool.submit(copy_out, int(version.version))))
            # The next version is logged while this one is copied out, as register does.
    assert [future.result() for _, future in copies] == [payload for payload, _ in copies]
    assert sorted(int(v.version) for v in client.search_model_versions("name='raced'")) == list(range(1, ROUNDS + 1))
    assert list(bare_environment.iterdir()) == []
    assert "MLFLOW_TRACKING_URI" not in os.environ


def test_the_client_names_its_store_as_registry_too(bare_environment, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = store.client(uri)
    assert (client.tracking_uri, client._registry_uri) == (uri, uri)


def test_clients_are_made_in_one_place_and_no_code_sets_mlflows_process_wide_state():
    """store.client names both URIs; a client made elsewhere, MLflow's fluent API or its environment
    variables set by hetflow would read or change what other threads read."""
    package = Path(store.__file__).parents[1]
    offending = re.compile(
        r"MlflowClient\(|mlflow\.(set_tracking_uri|set_registry_uri|start_run|log_\w+|register_model)\(|\.log_model\("
        r"|environ\[[^]]*MLFLOW_(TRACKING|REGISTRY)_URI"
    )
    found = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if offending.search(line) and path != Path(store.__file__)
    ]
    assert found == []

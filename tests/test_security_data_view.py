"""What of the prepared data a run's replicas are shown, on every backend: their own run's dataset (its
version folder, as prepare_data recorded it), not every run's data; bound at the resolved path that was
checked, and refused at provision when a link swapped in since would lead the bind elsewhere. Real
stages (validate_spec, prepare_data), a real bubblewrap sandbox, the backends' real configs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ATTEMPT
from digit_folders import write_digit_folder

from hetflow import sandbox
from hetflow.cluster.containers import ReplicaLaunch

# What a replica's process tries: the other datasets of the data dir, and its own data through the
# input pipeline every strategy reads.
_PROBE = ATTEMPT + textwrap.dedent(
    """
    import json, os, sys
    data, other = sys.argv[1], sys.argv[2]
    attempt("list-data-dir", lambda: print("data-dir", sorted(os.listdir(data))))
    attempt("read-other-dataset", lambda: os.listdir(other))
    import hetflow
    from hetflow.data.pipeline import split_arrays
    from hetflow.records import DatasetRecord
    dataset = DatasetRecord.model_validate_json(sys.argv[3])
    images, labels = split_arrays(dataset, "test")
    print("test-examples", len(labels))
    """
)


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("HETFLOW_HOME", str(home))
    monkeypatch.delenv("HETFLOW_DATA_ROOTS", raising=False)
    return home


def _prepared(values: dict, run_id: str) -> Path:
    """The run directory of ``run_id`` after validate_spec and prepare_data."""
    from hetflow.paths import run_paths
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.validate_spec import validate_spec

    validate_spec({"skip_unchanged": False, **values}, run_id)
    prepare_data(run_id)
    return run_paths(run_id).root


def _every_backends_read_only_data(run_dir: Path, home: Path) -> dict[str, list[str]]:
    """What of HETFLOW_HOME/data each backend shows the run's replicas, read-only."""
    from hetflow.cluster.backends.docker import backend as docker_backend
    from hetflow.cluster.backends.kubernetes import manifests as kubernetes_manifests
    from hetflow.cluster.backends.local.replicas import file_view
    from hetflow.cluster.backends.swarm import replicas as swarm_replicas
    from hetflow.spec import parse_spec

    under_data = str(home / "data")

    def data_only(paths) -> list[str]:
        return sorted(str(path) for path in paths if str(path).startswith(under_data))

    shown = {"local": data_only(file_view(parse_spec({}), run_dir)["read_only"])}
    for backend, module in (("docker", docker_backend), ("swarm", swarm_replicas)):
        spec = parse_spec({"backend": backend})
        layout = docker_backend.plan(spec, "data-view")
        if backend == "docker":
            config = module.container_config(ReplicaLaunch(layout, layout.replicas[0], spec, home, run_dir, "0:0", 0.0))
            shown[backend] = data_only(key for key, bind in config["volumes"].items() if bind["mode"] == "ro")
        else:
            config = module.service_config(ReplicaLaunch(layout, layout.replicas[0], spec, home, run_dir, "0:0", 0.0))
            shown[backend] = data_only(m["Source"] for m in config["mounts"] if m.get("ReadOnly"))
    shown["kubernetes"] = data_only(m["mountPath"] for m in kubernetes_manifests.volume_mounts(run_dir))
    return shown


def test_every_backend_shows_the_replicas_their_runs_dataset_and_no_other_data(home):
    from hetflow.data.prepare import prepare_dataset

    # Another run's images, prepared in the same data dir: this run's replicas have no business there.
    others = prepare_dataset(f"folder:{write_digit_folder(home / 'data' / 'their_images', per_class=3)}", home / "data")
    run_dir = _prepared({}, "data-view")
    prepared = json.loads((run_dir / "dataset.json").read_text())["prepared_dir"]
    assert prepared == str(home / "data" / "uci_digits" / "1.0.0")
    shown = _every_backends_read_only_data(run_dir, home)
    assert shown == {backend: [prepared] for backend in ("local", "docker", "swarm", "kubernetes")}
    assert others.prepared_dir not in str(shown)


def test_a_replica_reads_its_dataset_and_sees_no_other_data(home):
    """The local replica's sandbox, as its keeper makes it, with a replica's process in it: the input
    pipeline reads the run's dataset from its version folder alone; the rest of the data dir is not there."""
    from hetflow.cluster.backends.local.keeper import replica_environment
    from hetflow.cluster.backends.local.replicas import file_view
    from hetflow.paths import RunPaths
    from hetflow.pipeline.attempts import load_spec

    other = write_digit_folder(home / "data" / "their_images", per_class=3)
    run_dir = _prepared({}, "data-probe")
    RunPaths(run_dir).output.mkdir()  # as provisioning makes it
    view = file_view(load_spec(RunPaths(run_dir)), run_dir)
    box = sandbox.Sandbox(view["read_write"], view["read_only"], view["hidden"])
    dataset = (run_dir / "dataset.json").read_text()
    try:
        done = subprocess.run(
            box.command([sys.executable, "-c", _PROBE, str(home / "data"), str(other), dataset]),
            pass_fds=box.fds,
            env=replica_environment(),
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        box.close()
    assert done.returncode == 0, done.stderr
    seen = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert seen["data-dir"] == "['uci_digits']"  # the way to its version folder, nothing beside it
    assert seen["read-other-dataset"] == "FileNotFoundError 2"
    assert seen["test-examples"] == "359"


def _swap_the_data_dirs_link(home: Path, outside: Path) -> dict:
    """data_dir is a link in HETFLOW_HOME/data to a folder there when the run is validated and its data
    prepared; then it is pointed at a folder outside the allowed roots."""
    (home / "data" / "tfds").mkdir(parents=True)
    (home / "data" / "current").symlink_to(home / "data" / "tfds")
    return {"data_dir": str(home / "data" / "current")}


def _swap_the_version_folder(home: Path, outside: Path) -> dict:
    """The default data dir; then a link to a folder outside takes the place of the prepared dataset."""
    return {}


@pytest.mark.parametrize("swap", [_swap_the_data_dirs_link, _swap_the_version_folder], ids=["data_dir", "dataset"])
def test_provisioning_refuses_data_that_a_link_now_leads_elsewhere(home, tmp_path, swap):
    from hetflow.cluster.backends.local.replicas import file_view
    from hetflow.paths import RunPaths
    from hetflow.pipeline.attempts import load_spec

    outside = tmp_path / "outside"  # what the swap would show the replicas: the same layout, other files
    (outside / "uci_digits" / "1.0.0").mkdir(parents=True)
    (outside / "uci_digits" / "1.0.0" / "secret").write_text("not for replicas")
    values = swap(home, outside)
    run_dir = _prepared(values, f"swap-{swap.__name__}")
    prepared = json.loads((run_dir / "dataset.json").read_text())["prepared_dir"]
    assert Path(prepared).resolve() == Path(prepared)  # recorded as it was checked: resolved
    if values:
        (home / "data" / "current").unlink()
        (home / "data" / "current").symlink_to(outside)
    else:
        (home / "data" / "uci_digits").rename(home / "data" / "moved")
        (home / "data" / "uci_digits").symlink_to(outside / "uci_digits")
    spec = load_spec(RunPaths(run_dir))
    with pytest.raises(ValueError) as refused:
        file_view(spec, run_dir)
    message = str(refused.value)
    assert message.startswith(f"prepared data {prepared} ") and "\n" not in message
    assert str(outside / "uci_digits" / "1.0.0") in message or str(home / "data" / "current") in message

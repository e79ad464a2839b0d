"""What replicas write steers nothing, and the clean-up after them reaches nothing outside their run
directory. A hostile process in a replica's real sandbox tries to create the record that makes a run
``strategy=auto`` and to replace the records the pipeline rewrites while replicas run; a racing thread,
as a live replica would, swaps a folder for a link to a host folder while the clean-up runs; plan.json's
probes come from a replica and are checked before auto decides on them."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import textwrap
import threading

import pytest
from conftest import ATTEMPT, replica_sandbox, run_sandboxed_around

from hetflow.paths import NotRegularFile, RunPaths, create_run_dir, write_record

_HOSTILE = ATTEMPT + textwrap.dedent(
    """
    import json, os, sys
    paths = json.loads(sys.argv[1])
    def write(path, text):
        with open(path, "w") as handle:
            handle.write(text)
    def swap(path, text):  # a file it may not write: a new one, made where it may, renamed over it
        write(paths["root"] + "/forged", text)
        os.replace(paths["root"] + "/forged", path)
    forged = json.dumps({"cluster": {"backend": "docker", "image": "evil"}})
    attempt("create-requested", lambda: write(paths["requested_spec"], forged))
    attempt("create-nodes", lambda: write(paths["nodes"], "{}"))
    attempt("plant-restarts", lambda: os.mkfifo(paths["restarts"]))
    print("ready", "ok", flush=True)
    sys.stdin.readline()  # meanwhile the supervisor renames a new restarts.json into place
    attempt("rewrite-restarts", lambda: write(paths["restarts"], "[]"))
    attempt("swap-restarts", lambda: swap(paths["restarts"], "[]"))
    attempt("remove-restarts", lambda: os.unlink(paths["restarts"]))
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="hands the run directory to the sandbox's uid as provisioning does")
def test_a_replica_can_neither_make_a_run_auto_nor_touch_what_the_pipeline_rewrites(hetflow_env):
    from hetflow import sandbox
    from hetflow.cluster.supervisor import read_restarts

    if sandbox.unavailable():
        pytest.skip(sandbox.unavailable())
    paths, box = replica_sandbox("test_replica_writes")  # the output folder is the replicas' to write
    restart = {"replica": "worker-1", "exit_code": 137, "cause": "killed by SIGKILL", "action": "restarted worker-1"}
    records = {k: str(getattr(paths, k)) for k in ("requested_spec", "nodes", "restarts")}
    targets = {"root": str(paths.output), **records}  # "root": where it may write
    # Meanwhile the supervisor renames a new restarts.json into place.
    hostile = run_sandboxed_around(
        box, [sys.executable, "-c", _HOSTILE, json.dumps(targets)], lambda: write_record(paths.restarts, [restart])
    )
    assert hostile.returncode == 0, hostile.stderr
    seen = dict(line.split(" ", 1) for line in hostile.stdout.splitlines())
    attacks = ("create-requested", "create-nodes", "plant-restarts", "rewrite-restarts", "swap-restarts")
    for attack in (*attacks, "remove-restarts"):
        assert seen[attack] != "ok", f"{attack}: {seen[attack]}"
    # only provision_cluster records a run's request as auto
    assert not paths.requested_spec.exists() and not paths.nodes.exists()
    assert read_restarts(paths) == [restart]


def _request_and_plan(paths: RunPaths, probes) -> None:
    from hetflow.spec import parse_spec

    requested = parse_spec({"strategy": "auto", "workers": 2, "batch_size": 64, "registered_model": "digits"})
    write_record(paths.requested_spec, requested.model_dump(mode="json"))
    # The replica's copy of the spec is not read: the decision comes from the pipeline's request.
    forged = {"strategy": "parameter_server", "registered_model": "theirs", "backend": "docker", "image": "evil"}
    write_record(paths.plan, {"requested": forged, "probes": probes})


def _probe(worker: int, speed, step_seconds=0.09) -> dict:
    return {
        "worker": f"worker-{worker}",
        "batch": 32,
        "steps": 20,
        "examples_per_second": speed,
        "step_seconds": step_seconds,
        "model_parameters": 1000,
    }


def test_auto_decides_from_the_pipelines_request_and_only_the_probes_numbers(hetflow_env):
    from hetflow.tasks.provision_cluster import auto_decided

    paths = create_run_dir("test_auto_request")
    _request_and_plan(paths, [_probe(0, 700.0), _probe(1, 350.0)])
    decided = auto_decided(paths)
    assert decided.cluster.strategy == "multi_worker_mirrored" and decided.cluster.worker.balance_batches
    assert (decided.registry.model_name, decided.cluster.backend) == ("digits", "local")


@pytest.mark.parametrize(
    "probes, named",
    [
        ([_probe(0, 700.0), _probe(1, 350.0), _probe(2, 10.0)], r"probes must be a list of 2 probes"),
        ([_probe(0, 700.0)], r"probes must be a list of 2 probes"),
        ([_probe(0, 700.0), _probe(1, float("nan"))], r"probes\[1\]\.examples_per_second must be a positive number"),
        ([_probe(0, 700.0), _probe(1, 0.0)], r"probes\[1\]\.examples_per_second must be a positive number"),
        ([_probe(0, 700.0), _probe(1, "350")], r"probes\[1\]\.examples_per_second must be a positive number"),
        ([_probe(0, 700.0), _probe(1, 350.0, True)], r"probes\[1\]\.step_seconds must be a positive number"),
        ([_probe(0, 700.0), _probe(0, 350.0)], r"probes\[1\] must be worker-1's probe"),
        ({"worker-0": _probe(0, 700.0)}, r"probes must be a list of 2 probes"),
    ],
)
def test_probes_a_replica_wrote_are_checked_before_auto_decides(hetflow_env, probes, named):
    from hetflow.tasks.provision_cluster import auto_decided

    paths = create_run_dir("test_auto_probes")
    _request_and_plan(paths, probes)
    with pytest.raises(NotRegularFile, match=rf"plan\.json: {named}"):
        auto_decided(paths)


@pytest.mark.skipif(os.geteuid() != 0, reason="a chown outside the run directory is what is attacked")
@pytest.mark.parametrize("swapped", ["checkpoints", "checkpoints/nested"])
def test_the_clean_up_never_follows_a_folder_a_live_replica_swaps_for_a_link(tmp_path, swapped):
    from hetflow.cluster.replica_view import hand_over_writable, remove_what_replicas_planted

    paths = RunPaths(tmp_path / "run")
    (paths.checkpoints / "nested").mkdir(parents=True)
    victim = tmp_path / "host"  # a folder of the host's, outside the run directory
    victim.mkdir()
    (victim / "link").symlink_to("/etc/hostname")  # what the clean-up removes where it looks
    os.mkfifo(victim / "fifo")
    (victim / "data").write_text("the host's")
    before = {path.name: os.lstat(path) for path in victim.iterdir()}
    folder, parked, link = paths.output / swapped, tmp_path / "parked", tmp_path / "link"
    stop = threading.Event()

    def replica():  # the folder and a link to the host's folder change places, each step atomic
        while not stop.is_set():
            os.rename(folder, parked)
            os.symlink(victim, link)
            # The clean-up may make the checkpoints' folder anew, or remove the link, at any step.
            with contextlib.suppress(IsADirectoryError):
                os.rename(link, folder)
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(folder)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(link)
            os.rename(parked, folder)  # over an empty folder the clean-up made, if it did

    racer = threading.Thread(target=replica, daemon=True)
    racer.start()
    try:
        for _ in range(300):
            remove_what_replicas_planted(paths.root)
            hand_over_writable(paths, (4242, 4242))
    finally:
        stop.set()
        racer.join()
    after = {path.name: os.lstat(path) for path in victim.iterdir()}
    assert after.keys() == before.keys()
    assert {name: (s.st_uid, s.st_gid) for name, s in after.items()} == {n: (0, 0) for n in before}
    assert (victim / "data").read_text() == "the host's"
    hand_over_writable(paths, (4242, 4242))
    assert os.lstat(paths.checkpoints / "nested").st_uid == 4242  # what is the run's is handed over

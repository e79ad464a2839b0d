"""The swarm scenario of ``make chaos`` (bench/chaos.py): a node lost mid-training.

On a swarm of two Docker-in-Docker nodes (docker/swarm.sh, bench/swarm_nodes.py), a run of two
multi_worker_mirrored workers, one named to each node, with ``restart_policy=never``; once the worker
on node-2 has finished two epochs, node-2's container is killed (its dockerd and replicas die with
it, as a machine that loses power). What docs/backends.md promises: the run fails in ``train`` with
one line naming the node ("replica worker-1 killed by SIGKILL (its node node-2 went down)": the
policy restarts nothing, and a worker that names its node could not move anyway), and teardown leaves nothing
of it on the manager, on the surviving node or, once it is back, on the lost one. An earlier run of
the same home (through ``register``) keeps every byte of its directory and its registered version;
the failed run, re-run as after a Clear once node-2 is back, completes on both nodes.

Every stage runs as the DAG runs it after a Clear (chaos_scenarios.CLEAR_PASS), with the failing
stage's error printed to stderr (``NOTE_ERRORS``): the line a task log would end with.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

from chaos_runs import REPO_ROOT, Bench, docker_unavailable, environment, run_dir
from chaos_scenarios import CLEAR_PASS
from swarm_nodes import PREFIX, swarm

from hetflow.cluster.engine import LABEL_SOURCE, container_name, network_name, source_digest
from hetflow.paths import RunPaths

NODES = "node-1:1.0:cpu node-2:1.0:cpu"
LOST = "node-2"  # not the manager: with one manager the swarm's API dies with it (docs/backends.md)
SPEC = {
    "backend": "swarm",
    "strategy": "multi_worker_mirrored",
    "workers": 2,
    "worker_devices": [{"node": "node-1"}, {"node": "node-2"}],
    "encrypt_network": False,  # this machine's kernel has no IPsec ESP (tests/test_cluster_swarm_backend.py)
    "restart_policy": "never",
    "prune": False,
    "quantize": "none",
}
EPOCHS_DONE_AT_LOSS = 2
PASS_TIMEOUT_SECONDS = 1500.0
# How long the engines may take to remove a torn-down run's tasks, and a node to rejoin.
SETTLE_SECONDS = 60.0
REJOIN_SECONDS = 180.0
ERROR_MARK = "[chaos] failed: "

# Prepended to CLEAR_PASS: each stage's error, which CLEAR_PASS swallows as Airflow records a failed
# try, printed to stderr first (as JSON: the message may span lines).
NOTE_ERRORS = """
import importlib as _importlib, json as _json, sys as _sys
from hetflow.pipeline.attempts import STAGES as _STAGES
def _noted(stage):
    module = _importlib.import_module(f"hetflow.tasks.{stage}")
    function = getattr(module, stage)
    def noted(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as error:
            print("[chaos] failed: " + _json.dumps([stage, str(error)]), file=_sys.stderr, flush=True)
            raise
    setattr(module, stage, noted)
for _stage in _STAGES:
    _noted(_stage)
"""


def start_pass(bench: Bench, env: dict, run_id: str, values: dict, try_number: int, earlier: dict):
    """One try of every stage of the run (CLEAR_PASS), its output in files beside the homes."""
    name = f"{run_id}-try{try_number}"
    command = [sys.executable, "-c", NOTE_ERRORS + CLEAR_PASS, run_id, json.dumps(values), str(try_number)]
    with open(bench.root / f"{name}.out", "wb") as out, open(bench.root / f"{name}.err", "wb") as err:
        return name, subprocess.Popen([*command, json.dumps(earlier)], cwd=REPO_ROOT, env=env, stdout=out, stderr=err)


def finish_pass(bench: Bench, started: tuple) -> dict:
    """What the try returned (each stage's value), the stages' errors and summarize's."""
    name, process = started
    try:
        process.wait(timeout=PASS_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    out = (bench.root / f"{name}.out").read_text(errors="replace").strip().splitlines()
    err = (bench.root / f"{name}.err").read_text(errors="replace")
    errors = dict(json.loads(line[len(ERROR_MARK) :]) for line in err.splitlines() if line.startswith(ERROR_MARK))
    try:
        done = json.loads(out[-1])
    except (IndexError, ValueError):
        return {"returned": {}, "errors": errors, "crashed": f"exit {process.returncode}: {err[-1500:]}"}
    return {"returned": done["returned"], "errors": errors, "summarize_error": done["summarize_error"]}


def node_client(node: str):
    import docker

    return docker.DockerClient(base_url=f"unix:///run/{PREFIX}/{node}/docker.sock")


def objects_of(run_id: str, manager, nodes: dict) -> dict[str, list[str]]:
    """What of the run the swarm still has: services and networks on the manager, task containers
    and the overlay network on each node that answers."""
    from hetflow.cluster.engine import run_filter

    prefix, network = container_name(run_id, ""), network_name(run_id)
    found = {
        "services": sorted(s.name for s in manager.services.list(filters=run_filter(run_id))),
        "networks": sorted(n.name for n in manager.networks.list(filters=run_filter(run_id))),
    }
    for node, client in nodes.items():
        found[f"{node} containers"] = sorted(
            c.name for c in client.containers.list(all=True, filters={"name": prefix}) if c.name.startswith(prefix)
        )
        found[f"{node} networks"] = sorted(n.name for n in client.networks.list(names=[network]) if n.name == network)
    return found


def settled(run_id: str, manager, nodes: dict) -> dict:
    """``objects_of`` once nothing is left, or after SETTLE_SECONDS; with the seconds it took."""
    started = time.monotonic()
    while True:
        found = objects_of(run_id, manager, nodes)
        if not any(found.values()) or time.monotonic() - started > SETTLE_SECONDS:
            return {"left": found, "after_seconds": round(time.monotonic() - started, 1)}
        time.sleep(1)


def files_of(root: Path) -> dict[str, str]:
    """Every file under a run directory, by its SHA-256."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def registry_of(home: Path) -> dict[str, dict]:
    """Every version of every registered model of the home (the model and its TFLite twin), as
    ``name/version``: each one's MLflow run, source and status."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=environment(home)["MLFLOW_TRACKING_URI"])
    return {
        f"{v.name}/{v.version}": {"run_id": v.run_id, "source": v.source, "status": v.status}
        for v in client.search_model_versions()
    }


def wait_for_loss_point(started: tuple, paths: RunPaths) -> str | None:
    """The replica on the node to lose, once its log shows EPOCHS_DONE_AT_LOSS epochs finished; None
    if the run ended first."""
    process, header = started[1], f"Epoch {EPOCHS_DONE_AT_LOSS + 1}/"
    deadline = time.monotonic() + PASS_TIMEOUT_SECONDS
    while process.poll() is None and time.monotonic() < deadline:
        nodes = _nodes_of(paths)
        victim = next((name for name, node in nodes.items() if node == LOST), None)
        log = paths.logs / f"{victim}.log"
        if victim and log.exists() and header in log.read_text(errors="replace"):
            return victim
        time.sleep(0.5)
    return None


def revive(host, manager, node: str) -> float | None:
    """Start the node's container again; seconds until the swarm has it ready (it rejoins by itself)."""
    started = time.monotonic()
    host.containers.get(f"{PREFIX}-{node}").start()
    while time.monotonic() - started < REJOIN_SECONDS:
        states = {n.attrs["Description"]["Hostname"]: n.attrs["Status"]["State"] for n in manager.nodes.list()}
        if states.get(node) == "ready":
            return round(time.monotonic() - started, 1)
        time.sleep(1)
    return None


def node_lost_checks(seen: dict) -> dict[str, bool]:
    """The scenario's checks, from what it saw (``swarm_node_lost``'s ``seen``)."""
    lost_error = seen["lost"]["errors"].get("train", "")
    lost_summary, rerun_summary = seen["lost_summary"], seen["rerun_summary"]
    before, after_loss, after_rerun = seen["registry_before"], seen["registry_after_loss"], seen["registry_after_rerun"]
    return {
        "the earlier run completed on both nodes": seen["earlier_summary"].get("status") == "success"
        and set(seen["earlier_nodes"].values()) == {"node-1", LOST},
        f"the run failed in train, in one line naming the lost node: replica ... killed by SIGKILL (its node {LOST} "
        "went down)": seen["lost"]["returned"].get("train", "not run") is None
        and seen["victim"] is not None
        # The task log's headline is the message's first line (hetflow.pipeline.task_log.failure_headline).
        and f"replica {seen['victim']} killed by SIGKILL (its node {LOST} went down)" in lost_error.split("\n")[0],
        "its summary says failed at train": (lost_summary.get("status"), lost_summary.get("failed_stage"))
        == ("failed", "train"),
        "nothing of the run left on the manager nor on the surviving node, the lost one down": not any(
            seen["left_node_down"]["left"].values()
        ),
        f"nothing of the run left on {LOST} once it is back": seen["rejoined_after_seconds"] is not None
        and not any(seen["left_node_back"]["left"].values()),
        "the earlier run's directory unchanged, every file and byte": seen["earlier_files_before"]
        == seen["earlier_files_after_loss"]
        == seen["earlier_files_after_rerun"],
        "the registry unchanged by the lost run": bool(before) and after_loss == before,
        f"the re-run after {LOST} came back completed on both nodes": rerun_summary.get("status") == "success"
        and set(seen["rerun_nodes"].values()) == {"node-1", LOST},
        "the re-run added versions and left the earlier ones as they were": len(after_rerun) > len(before)
        and all(after_rerun.get(version) == found for version, found in before.items()),
        "docker/swarm.sh down left nothing on the engine": seen["swarm_left"] == [],
    }


def _summary(paths: RunPaths) -> dict:
    return json.loads(paths.summary.read_text()) if paths.summary.exists() else {}


def _nodes_of(paths: RunPaths) -> dict:
    """replicas/nodes.json: replica -> node; empty before it is written."""
    try:
        return json.loads(paths.nodes.read_text())
    except (OSError, ValueError):
        return {}


def _on_swarm(bench: Bench, env: dict, home: Path, seen: dict) -> None:
    """The three runs, the loss and the return of the node, on a swarm that is up (``env``)."""
    import docker

    earlier_id, lost_id = bench.run_id("swarm-earlier"), bench.run_id("swarm-node-lost")
    model = f"chaos-{bench.token}-swarm"
    spec = {**SPEC, "image": bench.image, "registered_model": model}
    manager = docker.DockerClient(base_url=env["DOCKER_HOST"])
    survivors = {node: node_client(node) for node in ("node-1",)}
    seen["earlier"] = finish_pass(bench, start_pass(bench, env, earlier_id, {**spec, "epochs": 3}, 1, {}))
    earlier, lost = RunPaths(run_dir(home, earlier_id)), RunPaths(run_dir(home, lost_id))
    seen["earlier_summary"], seen["earlier_nodes"] = _summary(earlier), _nodes_of(earlier)
    earlier_dir = earlier.root
    seen["earlier_files_before"], seen["registry_before"] = files_of(earlier_dir), registry_of(home)
    values = {**spec, "epochs": 10}
    started_at = time.monotonic()
    running = start_pass(bench, env, lost_id, values, 1, {})
    seen["victim"] = wait_for_loss_point(running, lost)
    if seen["victim"]:
        bench.docker.containers.get(f"{PREFIX}-{LOST}").kill()
        seen["lost_after_seconds"] = round(time.monotonic() - started_at, 1)
    seen["lost"] = finish_pass(bench, running)
    seen["lost_summary"] = _summary(lost)
    seen["left_node_down"] = settled(lost_id, manager, survivors)
    seen["earlier_files_after_loss"], seen["registry_after_loss"] = files_of(earlier_dir), registry_of(home)
    seen["rejoined_after_seconds"] = revive(bench.docker, manager, LOST) if seen["victim"] else 0.0
    seen["left_node_back"] = settled(lost_id, manager, {LOST: node_client(LOST)})
    seen["rerun"] = finish_pass(bench, start_pass(bench, env, lost_id, values, 2, seen["lost"]["returned"]))
    seen["rerun_summary"], seen["rerun_nodes"] = _summary(lost), _nodes_of(lost)
    seen["earlier_files_after_rerun"], seen["registry_after_rerun"] = files_of(earlier_dir), registry_of(home)


def swarm_node_lost(bench: Bench) -> dict:
    """The scenario (see the module's docstring); skipped without an engine or an image of this checkout."""
    skipped = docker_unavailable(bench)
    if not skipped and (bench.docker.images.get(bench.image).labels or {}).get(LABEL_SOURCE) != source_digest():
        skipped = f"the image {bench.image} was built from other code than this checkout (make image)"
    if skipped:
        return {"skipped": skipped, "faults": [], "runs": [], "checks": {}}
    from swarm_nodes import left_on_engine

    home = bench.home("swarm")
    seen: dict = {"swarm_left": None}
    try:
        with swarm({**environment(home), "IMAGE": bench.image}, NODES) as env:  # IMAGE: what swarm.sh loads
            _on_swarm(bench, env, home, seen)
    except Exception:  # swarm.sh up or down failed, or an engine stopped answering: reported as a crash
        seen["crashed"] = traceback.format_exc()[-3000:]
    seen["swarm_left"] = left_on_engine()
    earlier_id, lost_id = bench.run_id("swarm-earlier"), bench.run_id("swarm-node-lost")
    killed = seen.get("lost_after_seconds")
    runs = [
        (earlier_id, "complete", seen.get("earlier_summary", {}), seen.get("earlier", {})),
        (lost_id, "fail", seen.get("lost_summary", {}), seen.get("lost", {})),
        (lost_id, "complete", seen.get("rerun_summary", {}), seen.get("rerun", {})),
    ]
    return {
        "faults": [f"docker kill of {LOST}, running {seen['victim']}, at {killed:.0f} s"] if killed else [],
        "runs": [
            {
                "run_id": run_id,
                "home": str(home),
                "expected": expected,
                "completed": summary.get("status") == "success",
                # The lost run's train error is what the scenario expects (a check reads it), not trouble.
                "error": done.get("crashed")
                or "; ".join(f"{stage}: {e}" for stage, e in done.get("errors", {}).items() if expected != "fail")
                or None,
            }
            for run_id, expected, summary, done in runs
        ],
        "checks": node_lost_checks(seen) if "rerun" in seen else {},
        **({"crashed": seen["crashed"]} if "crashed" in seen else {}),
        "left_on_swarm": {lost_id: _left(seen)},
        "seen": {k: v for k, v in seen.items() if not k.startswith("earlier_files")},
    }


def _left(seen: dict) -> dict[str, list[str]]:
    """What of the lost run the swarm kept: with the node down, then on the node once it was back."""
    left: dict[str, list[str]] = {}
    for when in ("left_node_down", "left_node_back"):
        for kind, names in seen.get(when, {}).get("left", {}).items():
            left[kind] = sorted({*left.get(kind, []), *names})
    return left

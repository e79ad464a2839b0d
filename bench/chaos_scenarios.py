"""The scenarios of ``make chaos`` (bench/chaos.py), one function each. A scenario starts runs of
its own, injects its faults and returns what it injected and found:

- ``faults``: one line per fault injected;
- ``runs``: one entry per run: ``run_id``, ``home`` (its HETFLOW_HOME), ``expected`` (``complete``,
  ``fail`` or ``stopped``), ``completed``, and what the scenario measured of it;
- ``checks``: what the scenario checked, and whether it held;
- ``skipped``: why it did not run, where it could not (no Docker engine).

Runs are started and watched through bench/chaos_runs.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from chaos_runs import (
    REPO_ROOT,
    Bench,
    docker_unavailable,
    environment,
    epochs_completed,
    finish,
    leftovers,
    replica_count,
    run_dir,
    start,
    teardown,
    wait_for_epoch,
)

from hetflow.cluster.processes import run_replicas
from hetflow.paths import RunPaths
from hetflow.pipeline.attempts import STAGE_OUTPUTS, STAGES

# Airflow 3 stops a task with SIGTERM and SIGKILLs it this many seconds later (its task supervisor's
# kill(SIGTERM, force=True), escalation_delay 5 s).
AIRFLOW_GRACE_SECONDS = 5.0
# How long a stopped run's replicas are waited for: past the keepers' TERM grace (10 s) and its slack.
SETTLE_SECONDS = 30.0

SHAPES = {
    "sync": {"strategy": "multi_worker_mirrored", "workers": 2, "epochs": 12},
    "async": {"strategy": "parameter_server", "workers": 2, "ps": 1, "epochs": 12, "steps_per_epoch": 100},
}
VICTIMS = {"sync": ["worker-0", "worker-1"], "async": ["worker-0", "worker-1", "ps-0"]}
# The replica that writes training.json and logs every epoch: its log shows what was redone.
WATCHED = {"sync": "worker-0", "async": "chief-0"}

# One try of every stage of a run, as the DAG runs them after a Clear: teardown whatever happened
# (its trigger rule), later stages only after train succeeded, then summarize with what Airflow
# would hand it: this try's return values, None for the stage that failed and, for the stages that
# never ran, the return values of the earlier run (argv[4]): their XComs are deleted only when a
# try of theirs starts. Prints what the stages returned and summarize's error.
CLEAR_PASS = """
import importlib, json, sys
from hetflow.pipeline.attempts import STAGES
from hetflow.tasks.summarize import summarize
from hetflow.tasks.teardown_cluster import teardown_cluster
run_id, values, try_number, earlier = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
returned = {}
def ran(stage, *args):
    try:
        stage_function = getattr(importlib.import_module(f"hetflow.tasks.{stage}"), stage)
        returned[stage] = stage_function(*args, try_number=try_number)
    except Exception:
        returned[stage] = None
    return returned[stage] is not None
trained = all(ran(*call) for call in (("validate_spec", values, run_id), ("prepare_data", run_id),
    ("provision_cluster", run_id), ("train", run_id)))
teardown_cluster(run_id)
if trained:
    all(ran(*call) for call in (("evaluate", run_id), ("compress", run_id), ("export", run_id),
        ("register", run_id, "hetflow_train")))
error = None
try:
    summarize(run_id, {stage: returned.get(stage, earlier.get(stage)) for stage in STAGES})
except RuntimeError as failed:
    error = str(failed)
print(json.dumps({"returned": returned, "summarize_error": error}, default=str))
"""


def kill_run(bench: Bench, shape: str, name: str, victim: str | None) -> dict:
    """A run of ``shape`` with restart_policy=on_failure; once its watched replica has logged its
    second epoch, after a random delay, ``victim`` (a replica's name, or ``random``: one of
    VICTIMS) is SIGKILLed. ``victim`` None: undisturbed."""
    home, run_id = bench.home(), bench.run_id(name)
    values = {**SHAPES[shape], "restart_policy": "on_failure", "backoff_limit": 3}
    started = time.monotonic()
    supervisor = start(bench, home, run_id, values)
    paths = RunPaths(run_dir(home, run_id))
    watched_log = paths.logs / f"{WATCHED[shape]}.log"
    killed = None
    if victim and wait_for_epoch(supervisor, watched_log, 2):
        time.sleep(bench.rng.uniform(0, 5))
        victim = bench.rng.choice(VICTIMS[shape]) if victim == "random" else victim
        pid = run_replicas(run_id, home).get(victim)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed = {"replica": victim, "after_seconds": time.monotonic() - started}
    code, error = finish(bench, supervisor, run_id)
    training = json.loads(paths.training.read_text()) if code == 0 else {}
    epochs = epochs_completed(watched_log)
    return {
        "run_id": run_id,
        "home": str(home),
        "expected": "complete",
        "completed": code == 0,
        "shape": shape,
        "killed": killed,
        "wall_seconds": time.monotonic() - started,
        "restarts": json.loads(paths.restarts.read_text()) if paths.restarts.exists() else [],
        "epochs": values["epochs"],
        "epochs_completed": epochs,
        "epochs_redone": len(epochs) - len(set(epochs)),
        "final_attempt_epochs": training.get("epochs_done"),
        "final_val_accuracy": training.get("history", {}).get("val_accuracy", [None])[-1],
        "error": error,
    }


def _kills(runs: list[dict]) -> dict:
    killed = [r for r in runs if r["killed"]]
    return {
        "faults": [
            f"SIGKILL {r['killed']['replica']} of {r['run_id']} at {r['killed']['after_seconds']:.0f} s" for r in killed
        ],
        "runs": runs,
        "checks": {f"{r['run_id']}: the supervisor restarted what was killed": bool(r["restarts"]) for r in killed},
    }


def undisturbed(bench: Bench) -> dict:
    """One run of each shape, nothing injected: the reference wall time and accuracy."""
    return {
        "faults": [],
        "runs": [kill_run(bench, shape, f"undisturbed-{shape}", None) for shape in SHAPES],
        "checks": {},
    }


def kill_random(bench: Bench) -> dict:
    """The random kills: alternating shapes, a random replica (never the parameter-server chief)
    SIGKILLed at a random time after the first epoch."""
    return _kills(
        [kill_run(bench, list(SHAPES)[i % len(SHAPES)], f"kill-random-{i}", "random") for i in range(bench.runs)]
    )


def kill_chief(bench: Bench) -> dict:
    """The parameter-server chief, which coordinates training and writes the checkpoints, SIGKILLed."""
    return _kills([kill_run(bench, "async", "kill-chief", "chief-0")])


def kill_ps(bench: Bench) -> dict:
    """The parameter server, which holds the variables, SIGKILLed."""
    return _kills([kill_run(bench, "async", "kill-ps", "ps-0")])


def sigterm_train(bench: Bench, backend: str) -> dict:
    """The supervising process of a 2-worker run gets SIGTERM mid-training, as Airflow stops a
    task, and SIGKILL if it is still there ``AIRFLOW_GRACE_SECONDS`` later; measured: seconds until
    no replica of the run is left (processes, containers)."""
    skipped = docker_unavailable(bench) if backend == "docker" else None
    if skipped:
        return {"skipped": skipped, "faults": [], "runs": [], "checks": {}}
    home, run_id = bench.home(), bench.run_id(f"sigterm-{backend}")
    values = {**SHAPES["sync"], "epochs": 200, "backend": backend, "image": bench.image}
    supervisor = start(bench, home, run_id, values, teardown=False)
    started = time.monotonic()
    run = {"run_id": run_id, "home": str(home), "expected": "stopped", "completed": False, "backend": backend}
    if not wait_for_epoch(supervisor, RunPaths(run_dir(home, run_id)).logs / "worker-0.log", 2):
        code, error = finish(bench, supervisor, run_id)
        teardown(home, run_id)
        return {
            "faults": [],
            "runs": [{**run, "error": error or f"ended with {code} before its second epoch"}],
            "checks": {"the run was still training when the SIGTERM was due": False},
        }
    time.sleep(bench.rng.uniform(0, 2))
    supervisor.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    run["sigterm_after_seconds"] = sent - started
    gone_after, killed_by_bench = None, False
    while time.monotonic() - sent < SETTLE_SECONDS and (gone_after is None or supervisor.poll() is None):
        if supervisor.poll() is None and time.monotonic() - sent > AIRFLOW_GRACE_SECONDS and not killed_by_bench:
            supervisor.kill()
            killed_by_bench = True
        if gone_after is None and not replica_count(leftovers(bench, home, run_id)):
            gone_after = time.monotonic() - sent
        time.sleep(0.05)
    code, error = finish(bench, supervisor, run_id)
    run |= {
        "replicas_gone_after_seconds": gone_after,
        "supervisor_exit_code": code,
        "supervisor_killed_at_grace": killed_by_bench,
        "error": error,
    }
    faults = [f"SIGTERM to the train task of {run_id} at {run['sigterm_after_seconds']:.0f} s"]
    faults += [f"SIGKILL to it {AIRFLOW_GRACE_SECONDS:g} s later, as Airflow would"] if killed_by_bench else []
    checks = {
        f"no replica left {AIRFLOW_GRACE_SECONDS:g} s after SIGTERM": gone_after is not None
        and gone_after <= AIRFLOW_GRACE_SECONDS,
        "the train task ended within the grace, without SIGKILL": not killed_by_bench,
    }
    return {"faults": faults, "runs": [run], "checks": checks, "airflow_grace_seconds": AIRFLOW_GRACE_SECONDS}


def sigterm_local(bench: Bench) -> dict:
    return sigterm_train(bench, "local")


def sigterm_docker(bench: Bench) -> dict:
    return sigterm_train(bench, "docker")


def concurrent(bench: Bench) -> dict:
    """Two 2-worker runs released at the same moment on a HETFLOW_HOME of their own, where nobody
    has prepared the dataset: both prepare it at once."""
    home = bench.home("fresh")
    run_ids = [bench.run_id(f"concurrent-{i}") for i in range(2)]
    go = bench.root / "concurrent.go"
    ready = [bench.root / f"concurrent-{i}.ready" for i in range(2)]
    values = {**SHAPES["sync"], "epochs": 4}
    supervisors = [start(bench, home, r, values, together=(go, flag)) for r, flag in zip(run_ids, ready)]
    deadline = time.monotonic() + 300
    while not all(flag.exists() for flag in ready) and time.monotonic() < deadline:
        if any(s.poll() is not None for s in supervisors):
            break
        time.sleep(0.05)
    go.touch()
    runs = []
    for run_id, supervisor in zip(run_ids, supervisors):
        code, error = finish(bench, supervisor, run_id)
        runs.append(
            {"run_id": run_id, "home": str(home), "expected": "complete", "completed": code == 0, "error": error}
        )
    records = [RunPaths(run_dir(home, r)).dataset for r in run_ids]
    datasets = [json.loads(p.read_text()) for p in records if p.exists()]
    prepared = home / "data" / "uci_digits"
    index_path = home / "data" / "hetflow_fingerprints.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    fingerprints = {d["fingerprint"] for d in datasets}
    shards = len(list((prepared / "1.0.0").glob("*.tfrecord-*")))
    checks = {
        "both runs recorded their dataset": len(datasets) == 2,
        "one prepared copy (uci_digits/1.0.0 alone)": prepared.is_dir()
        and sorted(p.name for p in prepared.iterdir()) == ["1.0.0"],
        "one run prepared it, the other re-used that copy": sorted(d["reused"] for d in datasets) == [False, True],
        "both runs have one fingerprint": len(fingerprints) == 1,
        "the fingerprint index holds exactly that fingerprint": index == {"uci_digits": next(iter(fingerprints), None)},
        "the copy has the shards its record counts": bool(datasets) and shards == sum(datasets[0]["shards"].values()),
    }
    return {
        "faults": ["two runs started at the same moment on a dataset nobody had prepared"],
        "runs": runs,
        "checks": checks,
        "datasets": [{k: d[k] for k in ("reused", "fingerprint", "shards")} for d in datasets],
    }


def _clear_pass(bench: Bench, home: Path, run_id: str, values: dict, try_number: int, earlier: dict) -> dict:
    command = [sys.executable, "-c", CLEAR_PASS, run_id, json.dumps(values), str(try_number), json.dumps(earlier)]
    done = subprocess.run(command, cwd=REPO_ROOT, env=environment(home), capture_output=True, text=True)
    if done.returncode != 0:
        return {"returned": {}, "summarize_error": None, "error": done.stderr[-1500:]}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "error": None}


def clear_rerun(bench: Bench) -> dict:
    """A run that succeeds, then the same run again, as after an Airflow Clear, whose train fails
    (it runs out of time); the earlier run's return values stand in for the XComs of the stages
    that never ran again, the worst case for summarize."""
    home, run_id = bench.home(), bench.run_id("clear")
    model = f"chaos-{bench.token}-clear"
    first = _clear_pass(bench, home, run_id, {"epochs": 2, "registered_model": model}, 1, {})
    paths = RunPaths(run_dir(home, run_id))
    first_summary = json.loads(paths.summary.read_text()) if paths.summary.exists() else {}
    failing = {"epochs": 1000, "train_timeout_seconds": 10, "registered_model": model}
    second = _clear_pass(bench, home, run_id, failing, 2, first["returned"])
    summary = json.loads(paths.summary.read_text()) if paths.summary.exists() else {}
    reran = {stage: (value or {}).get("attempt", {}) for stage, value in second["returned"].items() if value}
    later = STAGE_OUTPUTS[STAGES.index("train") :]
    stale_files = [
        str(path.relative_to(paths.root))
        for stage, record in later
        for path in (getattr(paths, record), paths.attempt(stage))
        if path.exists()
    ]
    listed = summary.get("attempts", {})
    checks = {
        "the first run succeeded": first_summary.get("status") == "success",
        "the re-run's train failed": "train" in second["returned"] and second["returned"]["train"] is None,
        "the re-run's summary says failed at train": (summary.get("status"), summary.get("failed_stage"))
        == ("failed", "train"),
        "the summary lists only the re-run's attempts": bool(listed)
        and all(listed[s].get("id") == reran.get(s, {}).get("id") and listed[s].get("try_number") == 2 for s in listed)
        and not set(listed) & {stage for stage, _ in later},
        "no metric or registry of the first run in the summary": summary.get("metrics", {}).get("test_accuracy") is None
        and summary.get("registry") is None
        and summary.get("mlflow_run_id") is None,
        "no record or receipt of train or a later stage left": not stale_files,
    }
    return {
        "faults": ["re-run after Clear whose train fails (epochs=1000, train_timeout_seconds=10)"],
        "runs": [
            {
                "run_id": run_id,
                "home": str(home),
                "expected": "complete",
                "completed": first_summary.get("status") == "success",
                "error": first["error"],
            },
            {"run_id": run_id, "home": str(home), "expected": "fail", "completed": False, "error": second["error"]},
        ],
        "checks": checks,
        "summarize_error": second["summarize_error"],
        "stale_files": stale_files,
    }


SCENARIOS = {
    "undisturbed": undisturbed,
    "kill_random": kill_random,
    "kill_chief": kill_chief,
    "kill_ps": kill_ps,
    "sigterm_local": sigterm_local,
    "sigterm_docker": sigterm_docker,
    "concurrent": concurrent,
    "clear_rerun": clear_rerun,
}

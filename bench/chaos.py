"""``make chaos``: runs that lose a random replica at a random time, and finish anyway.

Each run trains the digits dataset with ``restart_policy=on_failure``, alternating a 2-worker
multi_worker_mirrored cluster and a parameter-server cluster (chief, 2 workers, 1 ps). Once the
watched replica has logged its first epoch, a random replica (never the parameter-server chief)
is killed with SIGKILL after a random delay. An undisturbed run of each shape gives the
reference wall time. Reported: completed / total, restarts, extra wall time, final validation
accuracy against the undisturbed run's.

Writes bench/results/chaos-<UTC timestamp>.json and bench/CHAOS.md.

    .venv/bin/python bench/chaos.py --runs 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from report import save  # bench/report.py: the scripts run as bench/<name>.py

REPO_ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "sync": {"strategy": "multi_worker_mirrored", "workers": 2, "epochs": 12},
    "async": {"strategy": "parameter_server", "workers": 2, "ps": 1, "epochs": 12, "steps_per_epoch": 100},
}
VICTIMS = {"sync": ["worker-0", "worker-1"], "async": ["worker-0", "worker-1", "ps-0"]}
WATCHED = {"sync": "worker-0", "async": "chief-0"}
SUPERVISOR = """
import json, sys
from tasks import stages
run_id, values = sys.argv[1], json.loads(sys.argv[2])
stages.validate_spec(values, run_id)
stages.prepare_data(run_id)
stages.provision_cluster(run_id)
try:
    stages.train(run_id)
finally:
    stages.teardown_cluster(run_id)
"""


def one_run(shape: str, run_id: str, env: dict, rng: random.Random | None) -> dict:
    """A run of ``shape``; with ``rng``, a random replica is killed at a random time."""
    from tasks.cluster.local import run_replicas
    from tasks.paths import run_paths

    values = {**SHAPES[shape], "restart_policy": "on_failure", "backoff_limit": 3}
    command = [sys.executable, "-c", SUPERVISOR, run_id, json.dumps(values)]
    started = time.monotonic()
    supervisor = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    killed = None
    if rng is not None:
        log = run_paths(run_id).logs / f"{WATCHED[shape]}.log"
        while supervisor.poll() is None and not (log.exists() and "Epoch 2/" in log.read_text()):
            time.sleep(0.2)
        time.sleep(rng.uniform(0, 5))
        victim = rng.choice(VICTIMS[shape])
        pid = run_replicas(run_id).get(victim)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed = {"replica": victim, "after_seconds": time.monotonic() - started}
    _, stderr = supervisor.communicate()
    paths = run_paths(run_id)
    record = json.loads(paths.training.read_text()) if supervisor.returncode == 0 else {}
    return {
        "shape": shape,
        "killed": killed,
        "completed": supervisor.returncode == 0,
        "wall_seconds": time.monotonic() - started,
        "restarts": json.loads(paths.restarts.read_text()) if paths.restarts.exists() else [],
        "final_val_accuracy": record.get("history", {}).get("val_accuracy", [None])[-1],
        "error": stderr.decode()[-1500:] if supervisor.returncode else None,
    }


def markdown(record: dict) -> str:
    runs, references = record["runs"], record["references"]
    completed = sum(r["completed"] for r in runs)
    lines = [
        "# Chaos runs",
        "",
        "Digits, `restart_policy=on_failure`; a random replica SIGKILLed at a random time after the "
        "first epoch; alternating sync (2-worker multi_worker_mirrored) and async (chief, 2 workers, 1 ps).",
        "",
        f"- date: {record['date']}",
        f"- command: `{record['command']}`",
        f"- completed: **{completed} / {len(runs)}**",
        "",
        "| shape | killed | completed | restarts | wall s | extra wall s vs undisturbed | final val acc "
        "| undisturbed |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        ref = references[r["shape"]]
        killed = f"{r['killed']['replica']} at {r['killed']['after_seconds']:.0f} s" if r["killed"] else "-"
        accuracy = f"{r['final_val_accuracy']:.4f}" if r["final_val_accuracy"] is not None else "-"
        lines.append(
            f"| {r['shape']} | {killed} | {'yes' if r['completed'] else 'NO'} | {len(r['restarts'])} | "
            f"{r['wall_seconds']:.0f} | {r['wall_seconds'] - ref['wall_seconds']:+.0f} | {accuracy} | "
            f"{ref['final_val_accuracy']:.4f} |"
        )
    extra = [r["wall_seconds"] - references[r["shape"]]["wall_seconds"] for r in runs if r["completed"]]
    if extra:
        lines += ["", f"Median extra wall time of a disturbed run: {statistics.median(extra):.0f} s."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="hetflow-chaos-") as home:
        env = {**os.environ, "HETFLOW_HOME": home, "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db"}
        os.environ.update(env)  # run_paths() and run_processes() in this process look where the runs are
        references = {shape: one_run(shape, f"reference_{shape}", env, None) for shape in SHAPES}
        runs = []
        for index in range(args.runs):
            shape = list(SHAPES)[index % len(SHAPES)]
            runs.append(one_run(shape, f"chaos_{index}", env, rng))
            print(f"[chaos] run {index + 1}/{args.runs}: {runs[-1]['killed']} completed={runs[-1]['completed']}")
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([".venv/bin/python", "bench/chaos.py", *sys.argv[1:]]),
        "references": references,
        "runs": runs,
    }
    save("chaos", record, "CHAOS.md", markdown(record))


if __name__ == "__main__":
    main()

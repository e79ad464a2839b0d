"""``make bench`` (straggler part): two workers, one slowed 2x, trained to the same target accuracy
by naive sync, balanced sync, async and ``strategy=auto``.

Every case trains ``model=convnet`` on ``dataset=synthetic_cifar`` (generated data) with
``hetflow train`` until validation accuracy reaches ``--target`` (checked every epoch of
``--steps-per-epoch`` steps). Worker 1 is throttled to half the CPU time (``worker_devices``
slowdown 2: a simulated slower machine). Reported per case, as medians over ``--repeats`` runs:
wall time of the whole command (process start, the probe where there is one, training to target),
training time to target, final validation accuracy and examples/s.

Writes bench/results/straggler-<UTC timestamp>.json and bench/STRAGGLER.md.

    .venv/bin/python bench/straggler.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO_ROOT / "bench"
BIN = Path(sys.executable).parent

WORKERS = '[{"threads": 1}, {"threads": 1, "slowdown": 2}]'
PER_WORKER_BATCH = 32
CASES = {
    "naive_sync": {"strategy": "multi_worker_mirrored", "batch_size": 2 * PER_WORKER_BATCH},
    "balanced_sync": {
        "strategy": "multi_worker_mirrored",
        "batch_size": 2 * PER_WORKER_BATCH,
        "balance_batches": "true",
    },
    # Async: each update is one worker's batch.
    "async": {"strategy": "parameter_server", "ps": 1, "batch_size": PER_WORKER_BATCH},
    "auto": {"strategy": "auto", "batch_size": 2 * PER_WORKER_BATCH},
}


def run_case(name: str, args: argparse.Namespace, home: str) -> dict:
    settings = {
        "dataset": "synthetic_cifar",
        "model": "convnet",
        "workers": 2,
        "worker_devices": WORKERS,
        "epochs": args.max_epochs,
        "steps_per_epoch": args.steps_per_epoch,
        "target_accuracy": args.target,
        **CASES[name],
    }
    command = [str(BIN / "hetflow"), "train", *(f"--set={k}={v}" for k, v in settings.items())]
    env = {**os.environ, "HETFLOW_HOME": home, "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db"}
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode:
        return {"case": name, "failed": done.stderr[-2000:], "command": shlex.join(command)}
    record_path = Path(done.stdout.strip().splitlines()[-1])
    record = json.loads(record_path.read_text())
    plan_path = record_path.parent / "plan.json"
    plan = json.loads(plan_path.read_text()) if plan_path.exists() else {}
    return {
        "case": name,
        "command": shlex.join(command),
        "wall_seconds": wall,
        "seconds_to_target": record["seconds_to_target"],
        "reached": record["seconds_to_target"] is not None,
        "epochs_done": record["epochs_done"],
        "final_val_accuracy": record["history"]["val_accuracy"][-1],
        "examples_per_second": record["examples_per_second"],
        "strategy": record["strategy"],
        "worker_batches": record.get("worker_batches"),
        "decision": plan.get("decision", {}).get("reason"),
        "probes": [p["examples_per_second"] for p in plan.get("probes", [])],
    }


def summarize(runs: list[dict]) -> dict[str, dict]:
    medians = {}
    for name in CASES:
        ok = [r for r in runs if r["case"] == name and "failed" not in r and r["reached"]]
        if not ok:
            medians[name] = {"failed": True}
            continue
        medians[name] = {
            key: statistics.median(r[key] for r in ok)
            for key in ("wall_seconds", "seconds_to_target", "final_val_accuracy", "examples_per_second")
        } | {"runs": len(ok)}
    return medians


def markdown(record: dict) -> str:
    medians, naive = record["medians"], record["medians"]["naive_sync"]
    lines = [
        "# Straggler benchmark",
        "",
        f"2 workers (1 thread each), worker 1 throttled to half the CPU time (a simulated 2x slower machine); "
        f"`model=convnet` on `dataset=synthetic_cifar` (generated), trained until validation accuracy >= "
        f"{record['target']} (checked every {record['steps_per_epoch']} steps); medians of {record['repeats']} "
        "runs per case. Wall: the whole `hetflow train` command (process start-up, the probe of balanced sync "
        "and auto, training). Train: training time until the target was reached.",
        "",
        f"- date: {record['date']}",
        f"- command: `{record['command']}`",
        f"- machine: {os.cpu_count()} CPUs",
        "",
        "| case | wall s | train s to target | train vs naive | wall vs naive | final val acc | examples/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in medians.items():
        if m.get("failed"):
            lines.append(f"| {name} | failed or never reached the target | | | | | |")
            continue
        lines.append(
            f"| {name} | {m['wall_seconds']:.1f} | {m['seconds_to_target']:.1f} | "
            f"{m['seconds_to_target'] / naive['seconds_to_target']:.2f} | "
            f"{m['wall_seconds'] / naive['wall_seconds']:.2f} | "
            f"{m['final_val_accuracy']:.4f} | {m['examples_per_second']:.0f} |"
        )
    decisions = sorted({r["decision"] for r in record["runs"] if r.get("decision")})
    lines += ["", "auto's decisions:", *[f"- {d}" for d in decisions]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--steps-per-epoch", type=int, default=25)
    parser.add_argument("--max-epochs", type=int, default=40)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-") as home:
        for repeat in range(args.repeats):
            for name in CASES:  # interleaved, so drift of the machine hits every case alike
                result = run_case(name, args, home)
                runs.append(result)
                print(
                    f"[straggler] {name} run {repeat + 1}/{args.repeats}: "
                    f"{result.get('seconds_to_target') or result.get('failed', '')}",
                    flush=True,
                )
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([".venv/bin/python", "bench/straggler.py", *sys.argv[1:]]),
        "target": args.target,
        "steps_per_epoch": args.steps_per_epoch,
        "repeats": args.repeats,
        "runs": runs,
        "medians": summarize(runs),
    }
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    (BENCH_DIR / "results").mkdir(exist_ok=True)
    (BENCH_DIR / "results" / f"straggler-{stamp}.json").write_text(json.dumps(record, indent=2))
    (BENCH_DIR / "STRAGGLER.md").write_text(markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()

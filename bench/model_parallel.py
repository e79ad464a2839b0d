"""``make bench`` (model parallelism): the same job as data parallelism, as model parallelism without
pipelining, and pipelined in 2, 4 and 8 micro-batches; then the measured layer split against the
parameter-count split on unequal workers.

- ``pipeline``: ``model=wide_mlp`` (67 M parameters on 32x32x3 images, 80 M) on generated data,
  global batch 1024, two workers of one thread each on this machine's two cores: ``multi_worker_mirrored``
  (each worker holds the whole model, half the batch) against ``model_parallel`` with ``workers=2``
  (each holds a layer group; a chief drives them) at ``micro_batches`` 1, 2, 4 and 8.
- ``split``: ``model=deep_mlp`` (layers of one size: a cut can give a stage nearly any share) on two
  unequal workers, 8 micro-batches: ``stage_split`` measured against parameters, the pair otherwise
  the same, for the slow worker last and first at half the CPU time (``slowdown`` 2) and last at a
  third (``slowdown`` 3).
- ``swarm_split``: the same pairs across a swarm of two nodes (docker/swarm.sh), node-2 with half a
  CPU, a worker named to each, the slow node last and first; the swarm is brought up once for them.

Every case is one ``hetflow train`` with a fixed number of steps. Reported per case, medians over
``--repeats``: wall time and whole-job examples/s (launch to final weights), time to first step,
steady examples/s and step time, each replica's peak resident memory (VmHWM from /proc), the cores
the replicas keep busy over the last epoch (their CPU seconds from /proc: a step's work is the same
pipelined or not, so the cores the unpipelined case leaves idle bound what pipelining can win), and
each worker's variable and optimizer-slot bytes. The pipeline bubble is the share of a stage's time
it waits, ``1 - t / T_M``: ``t`` one stage's work for the batch (half the unpipelined step, the
stages cut to equal time), ``T_M`` the pipelined step; its theory is (N-1)/(M+N-1).

Writes bench/results/model-parallel-<UTC timestamp>.json and bench/MODEL_PARALLEL.md;
``--summary-of RECORD`` rewrites the summary from a saved record, running nothing.

    .venv/bin/python bench/model_parallel.py [--repeats 1]
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
import threading
import time
from datetime import datetime
from pathlib import Path

from model_parallel_report import summary_text
from report import busy_cores, save  # bench/report.py: the scripts run as bench/<name>.py
from run import machine_facts
from swarm_nodes import swarm

from hetflow.cluster.processes import run_replicas

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

ONE_THREAD_EACH = '[{"threads": 1}, {"threads": 1}]'
COMMON = {"dataset": "synthetic_cifar", "workers": 2, "epochs": 2, "prune": "false", "quantize": "none"}
# A batch large enough that a micro-batch's matrix products stay bound by arithmetic: at 64, a stage
# moves all its weights through memory once per micro-batch: three of wide_mlp's layers, timed in one
# process on one thread, took 3.9x as long for 64 examples in 8 micro-batches as in one, more than
# pipelining can win back; for 1024, 1.1x.
PIPELINE = {**COMMON, "model": "wide_mlp", "batch_size": 1024, "steps_per_epoch": 6, "worker_devices": ONE_THREAD_EACH}
STAGES = {**PIPELINE, "strategy": "model_parallel", "stage_split": "parameters"}
SPLIT = {
    **COMMON,
    "model": "deep_mlp",
    "batch_size": 512,
    "steps_per_epoch": 10,
    "strategy": "model_parallel",
    "micro_batches": 8,
}
# Unequal workers: the slow one last and first, and a slower one last. On this machine ``slowdown``
# throttles a worker's CPU time; on the swarm, node-2 has half a CPU (docker --cpus), the quota a
# slower machine would be.
UNEQUAL_WORKERS = {
    "slow_last": '[{"threads": 1}, {"threads": 1, "slowdown": 2}]',
    "slow_first": '[{"threads": 1, "slowdown": 2}, {"threads": 1}]',
    "slow_last_3x": '[{"threads": 1}, {"threads": 1, "slowdown": 3}]',
}
SWARM_NODES = "node-1:1.0:cpu node-2:0.5:cpu"
UNEQUAL_NODES = {
    "slow_last": '[{"node": "node-1", "threads": 1}, {"node": "node-2", "threads": 1}]',
    "slow_first": '[{"node": "node-2", "threads": 1}, {"node": "node-1", "threads": 1}]',
}
# This machine's kernel has no IPsec ESP for an encrypted overlay (tests/test_cluster_swarm_backend.py).
ON_SWARM = {"backend": "swarm", "encrypt_network": "false"}


def split_pairs(workers: dict[str, str], backend: dict[str, str] | None = None) -> dict[str, dict]:
    """Per worker order, two cases that differ only in ``stage_split``."""
    return {
        f"{order}_by_{method}": {**SPLIT, **(backend or {}), "worker_devices": devices, "stage_split": stage_split}
        for order, devices in workers.items()
        for method, stage_split in (("parameters", "parameters"), ("measured_time", "measured"))
    }


CASES = {
    "pipeline": {
        "data_parallel": {**PIPELINE, "strategy": "multi_worker_mirrored"},
        **{f"stages_mb{m}": {**STAGES, "micro_batches": m} for m in (1, 2, 4, 8)},
    },
    "split": split_pairs(UNEQUAL_WORKERS),
    "swarm_split": split_pairs(UNEQUAL_NODES, ON_SWARM),
}
MEASURES = (
    "wall_seconds",
    "whole_job_examples_per_second",
    "time_to_first_step_seconds",
    "examples_per_second",
    "step_seconds",
)


def watch_replicas(run_home: Path, stop: threading.Event, peaks: dict[str, int], epochs: list[dict]) -> None:
    """Every 0.2 s until ``stop``, from /proc, for the run that starts after this call: each
    replica's VmHWM (peak resident memory, KiB) into ``peaks``, and, each time the chief's
    progress.jsonl gains an epoch, every replica's CPU seconds so far (user + system; a replica's
    last reading once it is gone) into ``epochs``."""
    cpu: dict[str, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    earlier = set((run_home / "runs").glob("*"))  # the cases before this one's
    while not stop.is_set():
        runs = sorted(set((run_home / "runs").glob("*")) - earlier, key=lambda p: p.stat().st_mtime)
        if runs:
            run_id = (runs[-1] / "run_id").read_text().strip() if (runs[-1] / "run_id").exists() else None
            for name, pid in (run_replicas(run_id, run_home) if run_id else {}).items():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                peak = int(status.split("VmHWM:")[1].split()[0])
                peaks[name] = max(peaks.get(name, 0), peak)
                cpu[name] = (int(stat[11]) + int(stat[12])) / ticks  # utime, stime
            progress = runs[-1] / "replica_output" / "progress.jsonl"
            done = len(progress.read_text().splitlines()) if progress.exists() else 0
            if done > (epochs[-1]["epochs"] if epochs else 0):
                epochs.append({"epochs": done, "at": time.monotonic(), "cpu_seconds": dict(cpu)})
        stop.wait(0.2)


def busy_cores_over_last_epoch(epochs: list[dict]) -> float | None:
    """The replicas' CPU seconds over the last epoch's wall seconds (steps and validation, traced in
    the epoch before): how many of the machine's cores training kept busy; None with one epoch or no
    replica found in this machine's /proc (a swarm's containers on this machine's nodes are found)."""
    if len(epochs) < 2 or not epochs[-1]["cpu_seconds"]:
        return None
    before, after = epochs[-2], epochs[-1]
    spent = sum(after["cpu_seconds"][name] - before["cpu_seconds"].get(name, 0.0) for name in after["cpu_seconds"])
    return spent / (after["at"] - before["at"])


def run_case(group: str, name: str, env: dict[str, str], home: Path) -> dict:
    settings = CASES[group][name]
    command = [str(BIN / "hetflow"), "train", *(f"--set={k}={v}" for k, v in settings.items())]
    peaks: dict[str, int] = {}
    epochs: list[dict] = []
    stop = threading.Event()
    watcher = threading.Thread(target=watch_replicas, args=(home, stop, peaks, epochs), daemon=True)
    watcher.start()
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    stop.set()
    watcher.join()
    run = {"group": group, "case": name, "command": shlex.join(command)}
    if done.returncode:
        return run | {"failed": done.stderr[-2000:]}
    record_path = Path(done.stdout.strip().splitlines()[-1])
    record = json.loads(record_path.read_text())
    plan_path = record_path.parent / "plan.json"
    split = json.loads(plan_path.read_text()).get("stage_split") if plan_path.exists() else None
    workers = record["per_worker"]
    return run | {
        "wall_seconds": wall,
        "whole_job_examples_per_second": record["whole_job_examples_per_second"],
        "time_to_first_step_seconds": record["time_to_first_step_seconds"],
        "examples_per_second": record["examples_per_second"],
        "step_seconds": min(worker["step_seconds"] for worker in workers.values()),
        "peak_rss_mib": {replica: kib / 1024 for replica, kib in sorted(peaks.items())},
        "busy_cores_last_epoch": busy_cores_over_last_epoch(epochs),
        "variable_bytes": {w: part.get("variable_bytes") for w, part in workers.items()},
        "slot_bytes": {w: part.get("slot_bytes") for w, part in workers.items()},
        "layers": {w: part.get("layers") for w, part in workers.items()},
        "stage_split": split,
    }


def medians(runs: list[dict]) -> dict[str, dict[str, dict]]:
    result: dict[str, dict[str, dict]] = {}
    for group, cases in CASES.items():
        result[group] = {}
        for name in cases:
            ok = [r for r in runs if (r["group"], r["case"]) == (group, name) and "failed" not in r]
            if not ok:
                result[group][name] = {"failed": True}
                continue
            peaks = {
                replica: statistics.median(r["peak_rss_mib"][replica] for r in ok if replica in r["peak_rss_mib"])
                for replica in ok[0]["peak_rss_mib"]
            }
            busy = [r["busy_cores_last_epoch"] for r in ok if r["busy_cores_last_epoch"] is not None]
            result[group][name] = {key: statistics.median(r[key] for r in ok) for key in MEASURES} | {
                "runs": len(ok),
                "busy_cores_last_epoch": statistics.median(busy) if busy else None,
                "peak_rss_mib": peaks,
                "variable_bytes": ok[0]["variable_bytes"],
                "slot_bytes": ok[0]["slot_bytes"],
                "layers": ok[0]["layers"],
                "stage_split": ok[0]["stage_split"],
            }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--summary-of", type=Path, help="rewrite bench/MODEL_PARALLEL.md from this record")
    args = parser.parse_args()
    if args.summary_of:
        record = json.loads(args.summary_of.read_text())
        save_summary(record, rewrite=True)
        return
    # Removed afterwards: each case's checkpoints of the wide model take about 1 GB.
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-mp-") as scratch:
        home = Path(scratch)
        env = {**os.environ, "HETFLOW_HOME": scratch, "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db"}
        runs, busy = [], []

        def run_group(group: str, group_env: dict[str, str]) -> None:
            for name in CASES[group]:
                busy.append(busy_cores())
                print(f"bench: {group} / {name}", flush=True)
                runs.append(run_case(group, name, group_env, home))

        for _ in range(args.repeats):
            run_group("pipeline", env)
            run_group("split", env)
        with swarm(env, SWARM_NODES) as swarm_env:  # brought up once: about 2 minutes
            for _ in range(args.repeats):
                run_group("swarm_split", swarm_env)
    record = {
        "when": datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_facts(),
        "repeats": args.repeats,
        "cases": CASES,
        "swarm_nodes": SWARM_NODES,
        "busy_cores_before": busy,
        "runs": runs,
        "medians": medians(runs),
    }
    save_summary(record)


def save_summary(record: dict, rewrite: bool = False) -> None:
    if rewrite:
        Path(__file__).with_name("MODEL_PARALLEL.md").write_text(summary_text(record))
        return
    save("model-parallel", record, "MODEL_PARALLEL.md", summary_text)


if __name__ == "__main__":
    main()

"""``make bench`` (model parallelism): the same job as data parallelism, as model parallelism without
pipelining, and pipelined in 2, 4 and 8 micro-batches; then the measured layer split against the
parameter-count split on unequal workers.

- ``pipeline``: ``model=wide_mlp`` (67 M parameters on 32x32x3 images, 80 M) on generated data,
  global batch 1024, two workers of one thread each on this machine's two cores: ``multi_worker_mirrored``
  (each worker holds the whole model, half the batch) against ``model_parallel`` with ``workers=2``
  (each holds a layer group; a chief drives them) at ``micro_batches`` 1, 2, 4 and 8.
- ``split``: ``model=deep_mlp`` (layers of one size: a cut can give a stage nearly any share) on two
  workers, 8 micro-batches, worker 1 at half the CPU time (``slowdown`` 2): ``stage_split`` measured
  against parameters.

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

from report import busy_cores, other_work_line, save  # bench/report.py: the scripts run as bench/<name>.py
from run import machine_facts

from hetflow.cluster.processes import run_replicas
from hetflow.models.stage_split import pipelined_step_seconds

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
    "worker_devices": '[{"threads": 1}, {"threads": 1, "slowdown": 2}]',
}
CASES = {
    "pipeline": {
        "data_parallel": {**PIPELINE, "strategy": "multi_worker_mirrored"},
        **{f"stages_mb{m}": {**STAGES, "micro_batches": m} for m in (1, 2, 4, 8)},
    },
    "split": {
        "by_parameters": {**SPLIT, "stage_split": "parameters"},
        "by_measured_time": {**SPLIT, "stage_split": "measured"},
    },
}
MEASURES = (
    "wall_seconds",
    "whole_job_examples_per_second",
    "time_to_first_step_seconds",
    "examples_per_second",
    "step_seconds",
)
# The aims (issue 39): pipelined >= 1.5x unpipelined at N = 2; each replica <= 0.6 of the model's
# variables and slots; the measured split <= 0.8x the parameter split's time on unequal workers.
PIPELINE_AIM, SHARE_AIM, SPLIT_AIM = 1.5, 0.6, 0.8


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
    the epoch before): how many of the machine's cores training kept busy; None with one epoch."""
    if len(epochs) < 2:
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


def slowest_stage_share(split: dict) -> float:
    """The share of the model's measured cost (plan.json's ``layer_seconds``) its slowest stage holds."""
    seconds, cuts = split["layer_seconds"], [0, *split["bounds"], len(split["layer_seconds"])]
    return max(sum(seconds[start:end]) for start, end in zip(cuts, cuts[1:])) / sum(seconds)


def overlap_ceiling(share: float, micro_batches: int, stages: int = 2) -> float:
    """The unpipelined step over the pipelined one where the stages overlap perfectly and a
    micro-batch costs nothing extra: GPipe's (M+N-1)/M slots of the slowest stage's share."""
    return 1 / ((micro_batches + stages - 1) / micro_batches * share)


def bubble(unpipelined_step: float, pipelined_step: float, stages: int = 2) -> float:
    """The measured share of a stage's time spent waiting (the module's docstring)."""
    return 1 - (unpipelined_step / stages) / pipelined_step


def cores_text(busy: float | None) -> str:
    return "not measured" if busy is None else f"{busy:.2f}"


def core_bound_lines(unpipelined_busy: float | None, cores: int) -> list[str]:
    """What the machine's cores leave pipelining: the work a step does is the same pipelined or not,
    so it can at most fill the cores the unpipelined step leaves idle."""
    if unpipelined_busy is None:
        return []
    return [
        f"- unpipelined, the replicas already keep {unpipelined_busy:.2f} of the machine's {cores} cores busy "
        "(within a stage, one layer's weight and input gradients and each stage's update run side by side; "
        "the chief reads the input): a step that does the same work on these cores can be at most "
        f"{cores / unpipelined_busy:.2f}x faster, whatever the split and the number of micro-batches"
    ]


def summary_text(record: dict) -> str:
    cases = record["medians"]
    pipeline, split = cases["pipeline"], cases["split"]
    lines = [
        "# Model parallelism: pipelining, memory per replica, and the split by measured time",
        "",
        f"Written by `bench/model_parallel.py` from `{record['results_file']}` ({record['when']}); "
        f"{record['machine']['nproc']} cores ({record['machine']['cpu_model']}), TensorFlow "
        f"{record['machine']['tensorflow']}, commit {record['machine']['git']}, {record['repeats']} run(s) per case.",
        other_work_line(record["busy_cores_before"], "before each case"),
        "",
        "## The same job: data parallel, model parallel, pipelined",
        "",
        f"`model=wide_mlp` on generated 32x32x3 images, global batch {PIPELINE['batch_size']}, 2 epochs x "
        f"{PIPELINE['steps_per_epoch']} steps, two workers of one thread each (model parallel: layer groups cut by "
        "parameters; a chief drives them).",
        "",
        "| case | command wall s | whole-job examples/s | first step s | steady examples/s | step s | "
        "cores busy, last epoch | peak RSS MiB per replica | variable + slot MB per worker |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, case in pipeline.items():
        if case.get("failed"):
            lines.append(f"| {name} | failed | | | | | | | |")
            continue
        peaks = ", ".join(f"{replica} {mib:.0f}" for replica, mib in case["peak_rss_mib"].items())
        held = (
            ", ".join(
                f"{worker} {((case['variable_bytes'][worker] or 0) + (case['slot_bytes'][worker] or 0)) / 1e6:.0f}"
                for worker in sorted(case["variable_bytes"])
            )
            if any(case["variable_bytes"].values())
            else "each the whole model"
        )
        lines.append(
            f"| {name} | {case['wall_seconds']:.1f} | {case['whole_job_examples_per_second']:.1f} | "
            f"{case['time_to_first_step_seconds']:.1f} | {case['examples_per_second']:.1f} | "
            f"{case['step_seconds']:.2f} | {cores_text(case.get('busy_cores_last_epoch'))} | {peaks} | {held} |"
        )
    lines += ["", "## What it shows, against the aims", ""]
    one = pipeline.get("stages_mb1", {})
    if not one.get("failed"):
        share = slowest_stage_share(one["stage_split"])
        lines.append(
            f"- the split's slowest stage holds {share:.2f} of the model's measured cost (the layers are cut whole: "
            f"plan.json's `layer_seconds`), which bounds what pipelining can win where stages overlap perfectly"
        )
        for micro in (2, 4, 8):
            case = pipeline.get(f"stages_mb{micro}", {})
            if case.get("failed"):
                continue
            theory = 1 / (micro + 1)
            lines.append(
                f"- {micro} micro-batches: step {case['step_seconds']:.2f} s against {one['step_seconds']:.2f} s "
                f"unpipelined ({one['step_seconds'] / case['step_seconds']:.2f}x; aim >= {PIPELINE_AIM}x at the best; "
                f"this split overlapping perfectly: {overlap_ceiling(share, micro):.2f}x); "
                f"bubble measured {bubble(one['step_seconds'], case['step_seconds']):.2f}, theory (N-1)/(M+N-1) = "
                f"{theory:.2f}"
            )
        lines += core_bound_lines(one.get("busy_cores_last_epoch"), record["machine"]["nproc"])
        best = max(
            (pipeline[f"stages_mb{m}"] for m in (2, 4, 8) if not pipeline.get(f"stages_mb{m}", {}).get("failed")),
            key=lambda c: -c["step_seconds"],
            default=None,
        )
        if best:
            speedup = one["step_seconds"] / best["step_seconds"]
            verdict = "meets" if speedup >= PIPELINE_AIM else "falls short of"
            lines.append(
                f"- pipelined at its best: {speedup:.2f}x the unpipelined step, which {verdict} the aim of "
                f"{PIPELINE_AIM}x"
            )
        total = sum((one["variable_bytes"][w] or 0) + (one["slot_bytes"][w] or 0) for w in one["variable_bytes"])
        shares = [
            ((one["variable_bytes"][w] or 0) + (one["slot_bytes"][w] or 0)) / total
            for w in sorted(one["variable_bytes"])
        ]
        verdict = "meets" if max(shares) <= SHARE_AIM else "falls short of"
        lines.append(
            f"- each worker's share of the model's variables and slots: {', '.join(f'{s:.2f}' for s in shares)}, "
            f"which {verdict} the aim of at most {SHARE_AIM} (data parallel: 1.00 on each)"
        )
    data = pipeline.get("data_parallel", {})
    fastest = min(
        (c for n, c in pipeline.items() if n.startswith("stages") and not c.get("failed")),
        key=lambda c: c["step_seconds"],
        default=None,
    )
    if fastest and not data.get("failed"):
        lines.append(
            f"- where the model fits: data parallel {data['whole_job_examples_per_second']:.1f} whole-job examples/s, "
            f"the fastest model parallel case {fastest['whole_job_examples_per_second']:.1f} "
            f"({data['whole_job_examples_per_second'] / fastest['whole_job_examples_per_second']:.2f}x in data "
            "parallelism's favour where above 1)"
        )
    job = record["cases"]["split"]["by_parameters"]
    lines += [
        "",
        "## Unequal workers: the split by measured time against the split by parameters",
        "",
        f"`model={job['model']}`, global batch {job['batch_size']} in micro_batches {job.get('micro_batches', 1)}, "
        f"2 epochs x {job['steps_per_epoch']} steps; `worker_devices={job['worker_devices']}`.",
        "",
        "| case | layers per worker | step s | steady examples/s | command wall s |",
        "|---|---|---|---|---|",
    ]
    for name, case in split.items():
        if case.get("failed"):
            lines.append(f"| {name} | failed | | | |")
            continue
        layers = "; ".join(f"{w}: {len(layers or [])}" for w, layers in sorted(case["layers"].items()))
        lines.append(
            f"| {name} | {layers} | {case['step_seconds']:.3f} | {case['examples_per_second']:.1f} | "
            f"{case['wall_seconds']:.1f} |"
        )
    measured, by_parameters = split.get("by_measured_time", {}), split.get("by_parameters", {})
    if not measured.get("failed") and not by_parameters.get("failed"):
        ratio = measured["step_seconds"] / by_parameters["step_seconds"]
        verdict = "meets" if ratio <= SPLIT_AIM else "falls short of"
        plan, micro_batches = measured["stage_split"], job.get("micro_batches", 1)
        by = {
            key: pipelined_step_seconds(plan[key], micro_batches)
            for key in ("stage_seconds", "parameter_stage_seconds")
        }
        predicted = by["stage_seconds"] / by["parameter_stage_seconds"]
        lines += [
            "",
            f"The measured split's step takes {ratio:.2f}x the parameter split's, which {verdict} the aim of at "
            f"most {SPLIT_AIM}x. Its plan predicted {predicted:.2f}x: each split's stage seconds (plan.json's "
            f"`stage_seconds`, `parameter_stage_seconds`) on GPipe's schedule at {micro_batches} micro-batches.",
        ]
    lines += ["", "Not measured here: the same cases on the swarm's two nodes (this bench runs on local only).", ""]
    return "\n".join(lines)


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
        for _ in range(args.repeats):
            for group, cases in CASES.items():
                for name in cases:
                    busy.append(busy_cores())
                    print(f"bench: {group} / {name}", flush=True)
                    runs.append(run_case(group, name, env, home))
    record = {
        "when": datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_facts(),
        "repeats": args.repeats,
        "cases": CASES,
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

"""``make bench`` (heterogeneous part): naive sync, balanced sync, async, single device and
``strategy=auto``, each trained to the same target accuracy on two clusters:

- ``straggler``: 2 workers (1 thread each), worker 1 throttled to half the CPU time
  (``worker_devices`` slowdown 2: a simulated 2x slower machine);
- ``even``: the same 2 workers, neither slowed;
- ``unequal_nodes`` (``--backend swarm``): 2 workers on a real swarm of two Docker-in-Docker nodes,
  one at 1.0 CPU and one at 0.5 (the CPU quota of the node's container bounds everything on it),
  one worker per node. The bench brings the swarm up with docker/swarm.sh (``make swarm``'s) and
  removes it afterwards.

Every case trains ``model=convnet`` on ``dataset=synthetic_cifar`` (generated data) with
``hetflow train`` and the same global batch until validation accuracy reaches ``--target``
(checked every ``--steps-per-epoch`` steps). Reported per case, as medians over ``--repeats``
runs: training time to target (from the first step, validation included), launch to target (from
the command's start: process start-up and measuring included), wall time of the whole command,
final validation accuracy and examples/s.

Writes bench/results/straggler-<UTC timestamp>.json and bench/STRAGGLER.md; with ``--backend
swarm``, bench/results/straggler-swarm-<UTC timestamp>.json and bench/STRAGGLER-SWARM.md.
``--summary-of RECORD`` rewrites the summary from a saved record, running nothing.

    .venv/bin/python bench/straggler.py --repeats 3 [--backend swarm]
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
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path

from report import BENCH_DIR, save  # bench/report.py: the scripts run as bench/<name>.py
from run import machine_facts, prepare_dataset
from swarm_nodes import left_on_engine, node_cpus, swarm

from hetflow.paths import RunPaths
from hetflow.replica.balance import MEASURE_SECONDS

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

PER_WORKER_BATCH = 64  # as in bench/run.py's throughput cases
GLOBAL_BATCH = 2 * PER_WORKER_BATCH
SYNC = {"strategy": "multi_worker_mirrored", "batch_size": GLOBAL_BATCH}
# Async: each update is one worker's batch.
# Naive and balanced sync run one loop, differing in the batch shares only: equal, or
# proportional to the speeds measured before the first step.
BALANCED = {**SYNC, "balance_batches": "true"}
ASYNC = {"strategy": "parameter_server", "ps": 1, "batch_size": PER_WORKER_BATCH}
AUTO = {"strategy": "auto", "batch_size": GLOBAL_BATCH}
UNEQUAL_CASES = {"naive_sync": SYNC, "balanced_sync": BALANCED, "async": ASYNC, "auto": AUTO}
# The swarm tests' nodes (tests/test_cluster_swarm_backend.py): the slower one has half the CPU of the other.
SWARM_NODES = "node-1:1.0:cpu node-2:0.5:cpu"
SCENARIOS = {
    "straggler": {
        "backend": "local",
        "workers": '[{"threads": 1}, {"threads": 1, "slowdown": 2}]',
        "baseline": "naive_sync",
        "cases": UNEQUAL_CASES,
    },
    "even": {
        "backend": "local",
        "workers": '[{"threads": 1}, {"threads": 1}]',
        "baseline": "sync",
        "cases": {
            "sync": SYNC,
            # The control: what probing and balancing cost where there is nothing to balance.
            "balanced_sync": BALANCED,
            "async": ASYNC,
            # The fastest worker alone, the whole global batch on it.
            "one_device": {
                "strategy": "one_device",
                "batch_size": GLOBAL_BATCH,
                "workers": 1,
                "worker_devices": '[{"threads": 1}]',
            },
            "auto": AUTO,
        },
    },
    "unequal_nodes": {
        "backend": "swarm",
        "workers": '[{"threads": 1, "node": "node-1"}, {"threads": 1, "node": "node-2"}]',
        # This machine's kernel has no IPsec ESP for an encrypted overlay (tests/test_cluster_swarm_backend.py).
        "settings": {"backend": "swarm", "encrypt_network": "false"},
        "baseline": "naive_sync",
        "cases": UNEQUAL_CASES,
    },
}
MEASURES = (
    "seconds_to_target",
    "launch_to_target_seconds",
    "before_first_step_seconds",
    "wall_seconds",
    "final_val_accuracy",
    "examples_per_second",
    "whole_job_examples_per_second",
    "validation_share",
)


def run_case(scenario: str, name: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    settings = {
        "dataset": "synthetic_cifar",
        "model": "convnet",
        "workers": 2,
        "worker_devices": SCENARIOS[scenario]["workers"],
        "epochs": args.max_epochs,
        "steps_per_epoch": args.steps_per_epoch,
        "target_accuracy": args.target,
        **SCENARIOS[scenario].get("settings", {}),
        **SCENARIOS[scenario]["cases"][name],
    }
    command = [str(BIN / "hetflow"), "train", *(f"--set={k}={v}" for k, v in settings.items())]
    launched_at, started = time.time(), time.monotonic()
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    run = {"scenario": scenario, "case": name, "command": shlex.join(command)}
    if done.returncode:
        return run | {"failed": done.stderr[-2000:]}
    record_path = Path(done.stdout.strip().splitlines()[-1])
    record = json.loads(record_path.read_text())
    paths = RunPaths(record_path.parents[1])  # training.json lies in the run's replica_output/
    plan_path = paths.plan
    plan = json.loads(plan_path.read_text()) if plan_path.exists() else {}
    nodes_path = paths.nodes  # backend=swarm: where each replica ran
    reached_at = record["target_reached_at"]
    launch_to_target = reached_at - launched_at if reached_at else None
    return run | {
        "wall_seconds": wall,
        "seconds_to_target": record["seconds_to_target"],
        "launch_to_target_seconds": launch_to_target,
        "before_first_step_seconds": launch_to_target - record["seconds_to_target"] if reached_at else None,
        "reached": reached_at is not None,
        "epochs_done": record["epochs_done"],
        "final_val_accuracy": record["history"]["val_accuracy"][-1],
        "examples_per_second": record["examples_per_second"],
        "whole_job_examples_per_second": record["whole_job_examples_per_second"],
        "validation_share": sum(record["validation_seconds"]) / sum(record["epoch_seconds"]),
        "strategy": record["strategy"],
        "worker_batches": record.get("worker_batches"),
        "decision": plan.get("decision", {}).get("reason"),
        "probes": [p["examples_per_second"] for p in plan.get("probes", [])],
        "nodes": json.loads(nodes_path.read_text()) if nodes_path.exists() else None,
    }


def summarize(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """Medians per scenario and case, over the runs that reached the target."""
    medians: dict[str, dict[str, dict]] = {}
    for scenario in dict.fromkeys(r["scenario"] for r in runs):
        medians[scenario] = {}
        for name in SCENARIOS[scenario]["cases"]:
            ok = [r for r in runs if (r["scenario"], r["case"]) == (scenario, name) and r.get("reached")]
            medians[scenario][name] = (
                {key: statistics.median(r[key] for r in ok) for key in MEASURES} | {"runs": len(ok)}
                if ok
                else {"failed": True}
            )
    return medians


INTRO = {
    "local": "2 workers (1 thread each) on this machine; in `straggler` worker 1 is throttled to half the CPU time "
    "(a simulated 2x slower machine), in `even` neither is.",
    "swarm": "2 workers (1 thread each) on a real Docker Swarm of two Docker-in-Docker nodes on this machine, one "
    "worker per node: {nodes}. A node's CPU quota bounds everything on it (its engine's containers sit in its "
    "cgroup); the chief and ps of async go where the swarm places them. The swarm is brought up by "
    "`docker/swarm.sh up` (`make swarm`'s) before the first run and removed after the last (left on the engine "
    "afterwards: {left}).",
}
SUMMARY = {"local": "STRAGGLER.md", "swarm": "STRAGGLER-SWARM.md"}
# The aims on unequal workers, from launch: balanced sync against naive sync, auto against the best case.
BALANCED_AIM = 0.75
AUTO_AIM = 1.10


def balance_bound(cases: dict[str, dict], runs: list[dict]) -> str | None:
    """What the measured speeds allow balanced sync from launch: with speeds s_i, an equal-share step lasts
    (B/n)/min(s), a balanced one B/sum(s), the same updates either way; the time before the first step is
    each case's own."""
    naive, balanced = cases.get("naive_sync", {}), cases.get("balanced_sync", {})
    probes = [r["probes"] for r in runs if r["case"] == "balanced_sync" and r.get("reached") and r["probes"]]
    if naive.get("failed") or balanced.get("failed") or not probes:
        return None
    steps = statistics.median(len(p) * min(p) / sum(p) for p in probes)
    train = naive["seconds_to_target"] * steps
    launch = naive["launch_to_target_seconds"]
    bound = (balanced["before_first_step_seconds"] + train) / launch
    measuring_free = (naive["before_first_step_seconds"] + train) / launch
    return (
        f"bound: the probes' speeds ({'; '.join(', '.join(f'{s:.0f}' for s in p) for p in probes)} examples/s) "
        f"make a balanced step {steps:.2f}x an equal-share one; naive sync's {naive['seconds_to_target']:.1f} s "
        f"of training at that rate is {train:.1f} s, after balanced sync's own "
        f"{balanced['before_first_step_seconds']:.1f} s before its first step (naive: "
        f"{naive['before_first_step_seconds']:.1f} s): at best {bound:.2f}x naive sync's {launch:.1f} s from "
        f"launch, {measuring_free:.2f}x if measuring cost nothing; {BALANCED_AIM}x needs at most "
        f"{BALANCED_AIM * launch - train:.1f} s before the first step"
    )


def markdown(record: dict) -> str:
    backend = record.get("backend", "local")
    intro = INTRO[backend].format(
        nodes=", ".join(f"{node} at {cpus:g} CPU" for node, cpus in record.get("swarm_nodes", {}).items()),
        left=", ".join(record.get("swarm_left", [])) or "nothing",
    )
    lines = [
        f"# Heterogeneous clusters: time to target{' on a swarm' if backend == 'swarm' else ''}",
        "",
        f"{intro} `model=convnet` on `dataset=synthetic_cifar` (generated), global "
        f"batch {GLOBAL_BATCH} (async: {PER_WORKER_BATCH} per update), trained until validation accuracy >= "
        f"{record['target']} (checked every {record['steps_per_epoch']} steps); medians of {record['repeats']} "
        "runs per case, cases interleaved.",
        "",
        "- **train s**: training time until the target was reached, from the first step (tracing and "
        "validation included); `vs` columns divide by the scenario's baseline (naive or plain sync).",
        "- **launch s**: from the command's start until the target, process start-up included, and measuring: "
        f"balanced sync and auto measure the workers for {MEASURE_SECONDS:.0f} s before their first step "
        "(auto in a launch of its own, then launches the workers as it decided); **before 1st step s**: launch s "
        "less train s.",
        "- **wall s**: the whole command, shutdown included.",
        "- every case runs one epoch loop (validation inside each epoch, a checkpoint after it); naive and "
        "balanced sync share their step too (validation split over the workers), differing in the batch "
        "shares only (equal, or by measured speed)"
        + ("; `balanced_sync` on the even cluster is the control" if "even" in record["medians"] else "")
        + ". async's step is scheduled by its chief, which validates alone.",
        "- **whole-job examples/s**: examples / launch to final weights; **validation share**: of the time in epochs.",
        "",
        f"- date: {record['date']}",
        f"- command: `{record['command']}`",
        f"- machine: {record['machine']['nproc']} CPUs ({record['machine']['cpu_model']}), "
        f"code at `{record['machine']['git']}`",
    ]
    for scenario, cases in record["medians"].items():
        baseline = cases[SCENARIOS[scenario]["baseline"]]
        lines += [
            "",
            f"## {scenario}",
            "",
            "| case | train s | train vs | launch s | launch vs | before 1st step s | wall s | final val acc "
            "| examples/s | whole-job examples/s | validation share |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, m in cases.items():
            if m.get("failed") or baseline.get("failed"):
                lines.append(f"| {name} | failed or never reached the target | | | | | | | | | |")
                continue
            lines.append(
                f"| {name} | {m['seconds_to_target']:.1f} | "
                f"{m['seconds_to_target'] / baseline['seconds_to_target']:.2f} | "
                f"{m['launch_to_target_seconds']:.1f} | "
                f"{m['launch_to_target_seconds'] / baseline['launch_to_target_seconds']:.2f} | "
                f"{m['before_first_step_seconds']:.1f} | "
                f"{m['wall_seconds']:.1f} | {m['final_val_accuracy']:.4f} | {m['examples_per_second']:.0f} | "
                f"{m['whole_job_examples_per_second']:.0f} | {m['validation_share']:.1%} |"
            )
        others = {name: m for name, m in cases.items() if name != "auto" and not m.get("failed")}
        auto = cases["auto"]
        if others and not auto.get("failed"):
            for measure in ("seconds_to_target", "launch_to_target_seconds"):
                best = min(others, key=lambda name: others[name][measure])
                ratio = auto[measure] / others[best][measure]
                lines += ["", f"auto vs the best other case by {measure}: {best}, {ratio:.2f}x"]
        runs = [r for r in record["runs"] if r["scenario"] == scenario]
        if SCENARIOS[scenario]["baseline"] == "naive_sync":
            lines += ["", *aims(cases, runs)]
        decisions = sorted({r["decision"] for r in runs if r.get("decision")})
        lines += ["", "auto's decisions:", *[f"- {d}" for d in decisions]]
        placed = sorted({json.dumps(r["nodes"], sort_keys=True) for r in runs if r.get("nodes")})
        if placed:
            lines += ["", "where the replicas ran (nodes.json):", *[f"- `{p}`" for p in placed]]
    return "\n".join(lines) + "\n"


def aims(cases: dict[str, dict], runs: list[dict]) -> list[str]:
    """The two aims from launch (BALANCED_AIM, AUTO_AIM), met or not, and what bounds balanced sync."""
    lines = []
    naive, balanced, auto = cases["naive_sync"], cases["balanced_sync"], cases["auto"]
    if not naive.get("failed") and not balanced.get("failed"):
        ratio = balanced["launch_to_target_seconds"] / naive["launch_to_target_seconds"]
        verdict = "met" if ratio <= BALANCED_AIM else "not met"
        lines.append(f"- balanced sync from launch: **{ratio:.2f}x** naive sync (aim <= {BALANCED_AIM}x: {verdict})")
    others = {name: m for name, m in cases.items() if name != "auto" and not m.get("failed")}
    if others and not auto.get("failed"):
        best = min(others, key=lambda name: others[name]["launch_to_target_seconds"])
        ratio = auto["launch_to_target_seconds"] / others[best]["launch_to_target_seconds"]
        verdict = "met" if ratio <= AUTO_AIM else "not met"
        lines.append(f"- auto from launch: **{ratio:.2f}x** the best case, {best} (aim <= {AUTO_AIM:.2f}x: {verdict})")
    bound = balance_bound(cases, runs)
    if bound:
        lines.append(f"- {bound}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.95)
    # Long enough that validation (1,000 examples, split over the workers) is under 5% of an epoch.
    parser.add_argument("--steps-per-epoch", type=int, default=50)
    parser.add_argument("--max-epochs", type=int, default=40)
    parser.add_argument("--backend", choices=("local", "swarm"), default="local")
    parser.add_argument("--scenarios", help="comma-separated subset of the backend's SCENARIOS (default: all)")
    parser.add_argument("--summary-of", type=Path, help="run nothing: rewrite the summary from this saved record")
    args = parser.parse_args()
    if args.summary_of:
        record = json.loads(args.summary_of.read_text())
        summary = markdown(record)
        (BENCH_DIR / SUMMARY[record.get("backend", "local")]).write_text(summary)
        print(summary)
        return
    own = [name for name, scenario in SCENARIOS.items() if scenario["backend"] == args.backend]
    scenarios = args.scenarios.split(",") if args.scenarios else own
    if not set(scenarios) <= set(own):
        parser.error(
            f"--scenarios={args.scenarios} is invalid with --backend={args.backend}: expected of {','.join(own)}"
        )
    runs = []
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-") as home:
        env = {**os.environ, "HETFLOW_HOME": home, "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db"}
        prepare_dataset(env)  # once, before the first case: no case's launch time includes building it
        with swarm(env, SWARM_NODES) if args.backend == "swarm" else nullcontext(env) as run_env:
            for repeat in range(args.repeats):
                for scenario in scenarios:
                    for name in SCENARIOS[scenario]["cases"]:  # interleaved: drift of the machine hits every case alike
                        result = run_case(scenario, name, args, run_env)
                        runs.append(result)
                        print(
                            f"[heterogeneous] {scenario}/{name} run {repeat + 1}/{args.repeats}: "
                            f"{result.get('seconds_to_target') or result.get('failed', '')}",
                            flush=True,
                        )
    swarm_facts = (
        {"swarm_nodes": node_cpus(SWARM_NODES), "swarm_left": left_on_engine()} if args.backend == "swarm" else {}
    )
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([".venv/bin/python", "bench/straggler.py", *sys.argv[1:]]),
        "backend": args.backend,
        **swarm_facts,
        "target": args.target,
        "steps_per_epoch": args.steps_per_epoch,
        "repeats": args.repeats,
        "machine": machine_facts(),
        "runs": runs,
        "medians": summarize(runs),
    }
    save("straggler" if args.backend == "local" else "straggler-swarm", record, SUMMARY[args.backend], markdown)


if __name__ == "__main__":
    main()

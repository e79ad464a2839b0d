"""``make chaos``: runs that lose replicas, get stopped, run at once and are re-run after a Clear.

The scenarios (bench/chaos_scenarios.py, one function each):

- undisturbed: one run of each shape, nothing injected (the reference);
- kill_random: a random replica (never the parameter-server chief) SIGKILLed at a random time,
  alternating a 2-worker multi_worker_mirrored cluster and a parameter-server one (chief, 2
  workers, 1 ps), restart_policy=on_failure;
- kill_chief, kill_ps: the parameter-server chief, the ps, SIGKILLed;
- sigterm_local, sigterm_docker: the train task gets SIGTERM mid-training (SIGKILL 5 s later if it
  is still there, as Airflow does); how long until no replica of the run is left;
- concurrent: two runs at the same moment on a dataset nobody has prepared;
- clear_rerun: a run re-run after a Clear, its train failing this time;
- swarm_node_lost (bench/chaos_swarm.py): on a swarm of two nodes, the node of one of a run's two workers
  killed mid-training; an earlier run's records and registered version kept, a re-run once it is back.

After every scenario the bench looks for what its runs left (processes, containers, networks) and
checks their records (every JSON parses, records agree with receipts); at the end it runs
``hetflow sweep``'s ``sweep(home)`` and reports what it still removed.

Writes bench/results/chaos-<UTC timestamp>.json and bench/CHAOS.md, every figure computed from
that JSON.

    .venv/bin/python bench/chaos.py --scenarios kill_chief,sigterm_local
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from datetime import datetime, timezone
from pathlib import Path

from chaos_runs import Bench, leftovers, replica_count, run_dir
from chaos_scenarios import SCENARIOS as ONE_MACHINE_SCENARIOS
from chaos_swarm import LOST, swarm_node_lost
from report import save  # bench/report.py: the scripts run as bench/<name>.py

from hetflow.paths import RunPaths
from hetflow.pipeline.attempts import STAGE_OUTPUTS, STAGES

# The swarm's last: it brings a swarm of its own up and down.
SCENARIOS = {**ONE_MACHINE_SCENARIOS, "swarm_node_lost": swarm_node_lost}


def record_problems(home: Path, run_id: str) -> list[str]:
    """What is corrupted in the run's directory: JSON that does not parse, and records that
    disagree with the receipts in attempts/ (see CHAOS.md's definition)."""
    paths = RunPaths(run_dir(home, run_id))
    problems = []
    for path in sorted(paths.root.rglob("*.json")):
        try:
            json.loads(path.read_text())
        except ValueError as error:
            problems.append(f"{path.relative_to(paths.root)} does not parse: {error}")
    receipts = {}
    for stage, record in STAGE_OUTPUTS:
        try:
            receipt = json.loads(paths.attempt(stage).read_text())
        except (OSError, ValueError):
            continue  # absent, or reported above
        if (receipt.get("stage"), receipt.get("run_id")) != (stage, run_id):
            problems.append(f"attempts/{stage}.json names stage {receipt.get('stage')} of run {receipt.get('run_id')}")
        if not getattr(paths, record).exists():
            problems.append(f"attempts/{stage}.json without its record {getattr(paths, record).name}")
        receipts[stage] = receipt
    if list(receipts) != list(STAGES[: len(receipts)]):
        problems.append(f"receipts {list(receipts)} are not the first stages': a later one outlived a re-run")
    try:
        summary = json.loads(paths.summary.read_text())
    except (OSError, ValueError):
        return problems
    listed = list(summary.get("attempts", {}))
    if listed != list(receipts)[: len(listed)]:
        problems.append(f"summary.json lists attempts {listed}, the receipts are {list(receipts)}")
    problems += [
        f"summary.json's {stage} attempt {summary['attempts'][stage].get('id')} is not its receipt's"
        for stage in listed
        if stage in receipts and summary["attempts"][stage].get("id") != receipts[stage].get("id")
    ]
    failed = STAGES[len(listed)] if len(listed) < len(STAGES) else None
    if summary.get("status") in ("success", "failed") and summary.get("failed_stage") != failed:
        problems.append(f"summary.json says failed at {summary.get('failed_stage')}, its attempts end before {failed}")
    if (summary.get("status") == "success") != (failed is None):
        problems.append(f"summary.json's status {summary.get('status')} with attempts {listed}")
    return problems


def run_scenario(bench: Bench, name: str) -> dict:
    """One scenario, then what its runs left and the state of their records."""
    started = time.monotonic()
    try:
        result = SCENARIOS[name](bench)
    except Exception:
        result = {"faults": [], "runs": [], "checks": {}, "crashed": traceback.format_exc()[-3000:]}
    result["seconds"] = time.monotonic() - started
    runs = {(Path(r["home"]), r["run_id"]) for r in result["runs"]}
    result["left"] = {run_id: leftovers(bench, home, run_id) for home, run_id in sorted(runs)}
    result["records"] = {run_id: record_problems(home, run_id) for home, run_id in sorted(runs)}
    return result


def sweep_and_clean(bench: Bench) -> dict:
    """``sweep(home)`` for every home of the bench, then whatever of its runs is still there, removed
    by the bench itself (so that nothing outlives it), each reported."""
    from hetflow.cluster.backends.base import sweep

    runs = [(home, path.read_text()) for home in sorted(bench.homes) for path in home.glob("runs/*/run_id")]
    swept = {str(home): sweep(home) for home in sorted(bench.homes)}
    after = {}
    for home, run_id in runs:
        found = leftovers(bench, home, run_id)
        if replica_count(found) or found["networks"]:
            after[run_id] = found
            for pid in found["processes"]:
                with contextlib.suppress(ProcessLookupError):  # gone since it was found
                    os.kill(pid, signal.SIGKILL)
            if bench.docker is not None:
                from hetflow.cluster.backends.docker.backend import teardown_run

                teardown_run(run_id, bench.docker)
    return {"swept": swept, "left_after_sweep": after}


def scenario_figures(result: dict) -> dict:
    """The table's figures of one scenario, from its record."""
    expected = [r for r in result["runs"] if r["expected"] == "complete"]
    redone = [r["epochs_redone"] for r in result["runs"] if "epochs_redone" in r]
    left = result["left"].values()
    on_swarm = result.get("left_on_swarm", {}).values()  # seen while the swarm was up
    return {
        "faults": len(result["faults"]),
        "completed": sum(r["completed"] for r in expected),
        "to_complete": len(expected),
        "checkpoints_lost": sum(redone) if redone else None,
        "replicas_left": sum(replica_count(found) for found in left)
        + sum(len(names) for found in on_swarm for kind, names in found.items() if not kind.endswith("networks")),
        "other_leftovers": sum(len(f["networks"]) for f in left)
        + sum(len(names) for found in on_swarm for kind, names in found.items() if kind.endswith("networks")),
        "records_corrupted": sum(len(problems) for problems in result["records"].values()),
        "checks_held": sum(result["checks"].values()),
        "checks": len(result["checks"]),
    }


def _row(name: str, f: dict) -> str:
    completed = f"{f['completed']} / {f['to_complete']}" if f["to_complete"] else "-"
    lost = "-" if f["checkpoints_lost"] is None else f["checkpoints_lost"]
    checks = f"{f['checks_held']} / {f['checks']}" if f["checks"] else "-"
    return (
        f"| {name} | {f['faults']} | {completed} | {lost} | {f['replicas_left']} | {f['other_leftovers']} | "
        f"{f['records_corrupted']} | {checks} |"
    )


DEFINITIONS = """\
What each figure counts (all computed from the results JSON):

- **faults injected**: kills, signals, simultaneous starts, failing stages and lost swarm nodes the bench caused.
- **runs completed**: runs that trained to the end (the Clear scenario: its first run, through summarize), of those
  meant to; a run stopped by SIGTERM or meant to fail is not counted.
- **checkpoints lost**: epochs trained twice. Over every start of the run's watched replica (worker-0 of the sync
  cluster, the chief of the async one; a restarted replica's output is appended to its log), the epochs it finished
  minus the distinct epochs among them: an epoch finished but missing from the checkpoint a restart resumed from is
  trained again. A worker restarted alone (async) redoes none; with `checkpoint_every=1` a whole-cluster restart
  loses an epoch only when the kill lands between an epoch's end and its checkpoint. The same figure is the epochs
  finished before the restart minus the epoch it resumed from (the run's epochs minus training.json's `epochs_done`,
  which counts the final attempt's; in the JSON as `final_attempt_epochs`).
- **replicas left**: right after the scenario, processes of its runs (keepers, sandboxes and replicas: the run id in
  their environment) and containers labelled with the run; on the swarm, while it is up, the run's services on the
  manager and its task containers on each node (the lost one once it is back). Goal: 0.
- **other leftovers**: a run's Docker network; on the swarm, its overlay network on the manager or a node.
- **records corrupted**: under each run directory, every `*.json` that does not parse, plus every disagreement between
  records and the receipts in `attempts/`: a receipt naming another stage or run, a receipt without its record,
  receipts that are not a prefix of the stages (a later stage's outliving an earlier stage's re-run), a
  `summary.json` whose attempts, status or failed stage disagree with the receipts. Goal: 0.
- **checks held**: the scenario's own checks, listed below.
"""


def markdown(record: dict) -> str:
    scenarios = record["scenarios"]
    ran = {name: s for name, s in scenarios.items() if not s.get("skipped")}
    figures = {name: scenario_figures(s) for name, s in ran.items()}
    totals = {key: sum(f[key] or 0 for f in figures.values()) for key in next(iter(figures.values()), {})}
    if totals and all(f["checkpoints_lost"] is None for f in figures.values()):
        totals["checkpoints_lost"] = None
    lines = ["# Chaos runs", "", f"- date: {record['date']}", f"- command: `{record['command']}`", "", DEFINITIONS]
    lines += [
        "| scenario | faults injected | runs completed | checkpoints lost | replicas left | other leftovers "
        "| records corrupted | checks held |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_row(name, f) for name, f in figures.items()]
    lines += [f"| {name} | skipped: {s['skipped']} | | | | | | |" for name, s in scenarios.items() if s.get("skipped")]
    if totals:
        lines.append(_row("**total**", totals))
    lines += (
        _kill_lines(ran)
        + _sigterm_lines(ran)
        + _swarm_lines(ran)
        + _check_lines(ran)
        + _trouble_lines(ran)
        + _sweep_lines(record)
    )
    return "\n".join(lines) + "\n"


def _kill_lines(ran: dict) -> list[str]:
    runs = [
        r for name in ("undisturbed", "kill_random", "kill_chief", "kill_ps") for r in ran.get(name, {}).get("runs", [])
    ]
    if not runs:
        return []
    references = {r["shape"]: r for r in ran.get("undisturbed", {}).get("runs", []) if r["completed"]}
    lines = [
        "",
        "## Kills",
        "",
        "Digits, `restart_policy=on_failure`, `backoff_limit=3`; the kill comes 0-5 s after the watched replica "
        "logged its second epoch.",
        "",
        "| run | shape | killed | completed | restarts | epochs done | epochs redone | wall s | extra wall s vs "
        "undisturbed | final val acc |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        killed = f"{r['killed']['replica']} at {r['killed']['after_seconds']:.0f} s" if r["killed"] else "-"
        ref = references.get(r["shape"])
        extra = f"{r['wall_seconds'] - ref['wall_seconds']:+.0f}" if ref and r["killed"] and r["completed"] else "-"
        accuracy = f"{r['final_val_accuracy']:.4f}" if r["final_val_accuracy"] is not None else "-"
        lines.append(
            f"| {r['run_id']} | {r['shape']} | {killed} | {'yes' if r['completed'] else 'NO'} | {len(r['restarts'])} "
            f"| {len(set(r['epochs_completed']))} of {r['epochs']} | {r['epochs_redone']} | {r['wall_seconds']:.0f} "
            f"| {extra} | {accuracy} |"
        )
    extra = [
        r["wall_seconds"] - references[r["shape"]]["wall_seconds"]
        for r in runs
        if r["killed"] and r["completed"] and r["shape"] in references
    ]
    if extra:
        lines += ["", f"Median extra wall time of a run that lost a replica: {statistics.median(extra):.0f} s."]
    return lines


def _sigterm_lines(ran: dict) -> list[str]:
    runs = [r for name in ("sigterm_local", "sigterm_docker") for r in ran.get(name, {}).get("runs", [])]
    if not runs:
        return []
    grace = next(ran[n]["airflow_grace_seconds"] for n in ("sigterm_local", "sigterm_docker") if n in ran)
    lines = [
        "",
        "## SIGTERM of the train task",
        "",
        "A 2-worker multi_worker_mirrored run's supervising process (running `hetflow.tasks.train.train`) "
        f"gets SIGTERM after its second epoch, and SIGKILL {grace:g} s later if it is still there, as Airflow 3 does.",
        "",
        "| backend | SIGTERM at s | no replica left after s | train task |",
        "|---|---:|---:|---|",
    ]
    for r in runs:
        if "sigterm_after_seconds" not in r:
            lines.append(f"| {r['backend']} | not sent: the run ended first | | |")
            continue
        gone = f"{r['replicas_gone_after_seconds']:.1f}" if r["replicas_gone_after_seconds"] is not None else "never"
        ended = (
            f"SIGKILLed at {grace:g} s" if r["supervisor_killed_at_grace"] else f"exited {r['supervisor_exit_code']}"
        )
        lines.append(f"| {r['backend']} | {r['sigterm_after_seconds']:.0f} | {gone} | {ended} |")
    return lines


def _swarm_lines(ran: dict) -> list[str]:
    seen = ran.get("swarm_node_lost", {}).get("seen")
    if not seen or "lost" not in seen:
        return []
    error = seen["lost"]["errors"].get("train", "(none)").strip().splitlines() or ["(empty)"]
    rejoined = seen.get("rejoined_after_seconds")
    return [
        "",
        "## A swarm node lost",
        "",
        f"Two multi_worker_mirrored workers, one named to each of two swarm nodes, `restart_policy=never`; {LOST}'s "
        f"container killed once its worker ({seen['victim']}) had finished two epochs, "
        f"{seen.get('lost_after_seconds', 0):.0f} s after the run started.",
        "",
        f"- the train task's error: `{error[0][:300]}`" + (f" (and {len(error) - 1} more lines)" if error[1:] else ""),
        f"- nothing of the run on the manager and the surviving node after "
        f"{seen['left_node_down']['after_seconds']:.1f} s; {LOST} ready again "
        + (f"{rejoined:.0f} s after its start" if rejoined is not None else "**never**")
        + f", nothing of the run on it after {seen['left_node_back']['after_seconds']:.1f} s",
        f"- the re-run: {seen['rerun_summary'].get('status', 'no summary')}, on "
        + (", ".join(f"{r} on {n}" for r, n in sorted(seen["rerun_nodes"].items())) or "no node"),
    ]


def _check_lines(ran: dict) -> list[str]:
    lines = ["", "## Checks", ""]
    for name, s in ran.items():
        lines += [f"- {name}: {'held' if held else '**FAILED**'}: {check}" for check, held in s["checks"].items()]
    return lines


def _trouble_lines(ran: dict) -> list[str]:
    """Everything that went wrong, as the JSON has it: crashes, failed runs, leftovers, records."""
    lines = []
    for name, s in ran.items():
        if s.get("crashed"):
            lines.append(f"- {name} crashed: `{s['crashed'].strip().splitlines()[-1]}`")
        for r in s["runs"]:
            # A stopped run's error is its SIGTERM; one that ended before the SIGTERM failed by itself.
            if r.get("error") and (r["expected"] != "stopped" or "sigterm_after_seconds" not in r):
                lines.append(f"- {name}, {r['run_id']}: `{r['error'].strip().splitlines()[-1][:300]}`")
        for run_id, found in s["left"].items():
            if replica_count(found) or found["networks"]:
                lines.append(f"- {name}, {run_id} left: `{json.dumps(found)}`")
        for run_id, problems in s["records"].items():
            lines += [f"- {name}, {run_id}: {problem}" for problem in problems]
    return ["", "## What went wrong", "", *lines] if lines else ["", "## What went wrong", "", "Nothing."]


def _sweep_lines(record: dict) -> list[str]:
    lines = [
        "",
        "## Final sweep",
        "",
        "`hetflow.cluster.backends.base.sweep(home)` for each HETFLOW_HOME of the bench:",
        "",
    ]
    for home, found in record["sweep"]["swept"].items():
        lines.append(f"- `{Path(home).name}`: containers {found['containers']}, networks {found['networks']}")
    left = record["sweep"]["left_after_sweep"]
    lines += ["", f"Still there after the sweep, removed by the bench: {', '.join(left) if left else 'nothing'}."]
    return lines


def docker_client():
    """A client of the Docker engine, or None and why none answers."""
    try:
        import docker

        client = docker.from_env()
        client.ping()
        return client, None
    except Exception as error:  # no SDK, no socket, an engine that does not answer: all mean no docker
        return (
            None,
            f"no Docker engine answers ({str(error).splitlines()[0][:200] if str(error) else type(error).__name__})",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=4, help="runs of kill_random")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--image", default="hetflow-replica:0.1.0", help="replica image of sigterm_docker")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of: {', '.join(SCENARIOS)}")
    args = parser.parse_args()
    chosen = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}: expected some of {', '.join(SCENARIOS)}")
    client, missing = docker_client()
    with tempfile.TemporaryDirectory(prefix="hetflow-chaos-") as root:
        bench = Bench(
            Path(root), uuid.uuid4().hex[:6], random.Random(args.seed), args.runs, client, missing, args.image
        )
        scenarios = {}
        for name in chosen:
            print(f"[chaos] {name} ...", flush=True)
            scenarios[name] = run_scenario(bench, name)
            figures = scenario_figures(scenarios[name])
            print(f"[chaos] {name}: {scenarios[name].get('skipped') or figures}", flush=True)
        swept = sweep_and_clean(bench)
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([".venv/bin/python", "bench/chaos.py", *sys.argv[1:]]),
        "seed": args.seed,
        "scenarios": scenarios,
        "sweep": swept,
    }
    save("chaos", record, "CHAOS.md", markdown)


if __name__ == "__main__":
    main()

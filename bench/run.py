"""``make bench``: training throughput (examples/s) of the benchmark convnet on generated CIFAR-shaped data.

Every case trains ``model=convnet`` on ``dataset=synthetic_cifar`` (generated data, see
hetflow/data/synthetic_images.py) with 64 examples per worker per step, for a fixed number of steps:

  baseline     a plain single-process ``model.fit`` (bench/baseline.py): no hetflow cluster, default threads
  one_worker   ``hetflow train``, one replica, one_device, one TensorFlow thread
  mwms_2       ``hetflow train``, 2 workers, multi_worker_mirrored, one thread each, pinned to a core each
  ps_2w_1ps    ``hetflow train``, a chief, 2 workers and 1 ps, parameter_server, one thread each, pinned
               as mwms_2 (the workers a core each; the ps shares worker-0's, the chief worker-1's);
               each step is one worker's batch
  two_apart    two one_worker jobs at once, each pinned to a core of its own: no communication at
               all, so their summed examples/s is what two single-threaded workers can reach on
               this machine (the ceiling for mwms_2, which adds the all-reduce)
  ray_2w       optional, not run by default (it installs Ray on first use): mwms_2's job under a peer,
               Ray Train's ``TensorflowTrainer``, 2 workers, one thread each, not pinned (bench/ray_peer.py)

The headline is whole-command examples/s: examples trained / wall time from the command's start
to its exit, what a user waits for (for copies side by side: until the last exits). Beside it,
whole-job examples/s: over the time from the same start to the final weights written, as the chief
records it in training.json (``whole_job_examples_per_second``), with where that time went
(``whole_job_breakdown``: start-up, first step, other steps, validation, between epochs
(checkpoints), shutdown) and the command's exit after the weights; then the in-epoch rate
(examples over the time in epochs, validation included) and ``steady`` (the last epoch alone).
Dataset preparation comes before the start and is in no case's time. Each case runs
``--repeats`` times, the repeats interleaved across cases so a drift of the machine hits every case
alike; medians are reported. With mwms_2 and ray_2w both run,
their ratios (whole-job examples/s and time to first step, ours / Ray's) are reported too; with
mwms_2, two_apart and one_worker, mwms_2's share of the two-core ceiling. With mwms_2, once per
bench run: its collectives' seconds per step (training.json's ``collectives``, timed alone by the
workers, see hetflow/replica/collectives.py) beside a bound measured here after the cases, the same
bytes all-reduced by two processes over a loopback socket (bench/socket_bound.py), and their ratio.
With ps_2w_1ps: its whole-command examples/s against two_apart's (both as multiples of one_worker's),
and its communication per step (training.json's ``communication``: every variable read onto a
worker and an update of its size sent back, timed alone through the coordinator, see
hetflow/replica/ps_exchange.py) beside the same bytes sent there and back between two processes over
a loopback socket (bench/socket_bound.py's round_trip), and their ratio.

Writes bench/results/throughput-<UTC timestamp>.json and bench/RESULTS.md.

    make bench
    make bench ARGS="--cases baseline,one_worker --repeats 1 --steps-per-epoch 50"
    make bench-peer    # baseline, one_worker, mwms_2, two_apart and ray_2w
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from report import busy_cores, save  # bench/report.py: the scripts run as bench/<name>.py
from throughput_bounds import (
    CEILING_PAIR,
    PS_CASE,
    ceiling_comparison,
    collectives_against_bound,
    peer_comparison,
    ps_communication_against_bound,
)
from throughput_cases import (
    BIN,
    CASE_NAMES,
    CASES,
    COMMON,
    DEFAULT_CASES,
    PEER_LOCK,
    PEER_PACKAGES,
    PER_WORKER_BATCH,
    REPO_ROOT,
    Case,
    RunFailed,
    case_command,
)
from throughput_report import markdown

from hetflow.paths import RunPaths


def prepare_dataset(env: dict[str, str]) -> None:
    """Prepare the dataset in the bench's home before the first case, so no case's time to first
    step includes building it. In a subprocess: the bench process itself stays free of TensorFlow."""
    code = (
        "from hetflow.data.prepare import prepare_dataset; from hetflow.paths import data_dir; "
        f"prepare_dataset({COMMON['dataset']!r}, data_dir())"
    )
    done = subprocess.run([str(BIN / "python"), "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench: preparing {COMMON['dataset']} failed:\n{done.stderr[-3000:]}")


def install_peer() -> None:
    """Install PEER_LOCK into PEER_PACKAGES, unless the same lock is installed there already; no
    dependencies resolved: the lock lists all that .venv lacks."""
    stamp = PEER_PACKAGES / ".installed-lock"
    if stamp.exists() and stamp.read_text() == PEER_LOCK.read_text():
        return
    print(f"[bench] installing {os.path.relpath(PEER_LOCK, REPO_ROOT)} into {PEER_PACKAGES} ...", flush=True)
    shutil.rmtree(PEER_PACKAGES, ignore_errors=True)  # a half or older install is not built upon
    command = [str(BIN / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(PEER_PACKAGES)]
    done = subprocess.run([*command, "-r", str(PEER_LOCK)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RunFailed(f"installing {PEER_LOCK.name} failed:\n{done.stderr[-3000:]}")
    stamp.write_text(PEER_LOCK.read_text())


def run_once(case: Case, command: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run one case once; return its training record (training.json's fields, less the history).
    A case of several copies side by side returns the slower copy's record (the pair's job ends with
    it) with the copies' records under ``copies``."""
    if case.peer:
        env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(PEER_PACKAGES), env.get("PYTHONPATH")]))}
    started = time.time()
    env = {**env, "HETFLOW_LAUNCH_TIME": repr(started)}
    if case.side_by_side > 1:
        commands = [["taskset", "-c", str(core), *command] for core in range(case.side_by_side)]
    else:
        commands = [command]
    running = [
        subprocess.Popen(copy, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for copy in commands
    ]
    try:
        records = [_record(case, process, timeout) for process in running]
        ended = time.time()  # the last copy's exit: each _record waits for its process
    finally:
        # hetflow's replicas die with a killed `hetflow train` (their keepers lose its lease), Ray's
        # with its driver.
        for process in running:
            if process.poll() is None:
                process.kill()
                process.communicate()
    command = {
        "whole_command_seconds": ended - started,
        "exit_after_weights_seconds": ended - max(record["weights_written_at"] for record in records),
    }
    records = [{**record, **command} for record in records]
    if len(records) == 1:
        return records[0]
    return {**max(records, key=lambda record: record["whole_job_seconds"]), "copies": records}


def _record(case: Case, process: subprocess.Popen, timeout: float) -> dict[str, Any]:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"{case.name}: no result after {timeout:.0f} s") from None
    if process.returncode != 0:
        tail = "\n".join((stdout + stderr).strip().splitlines()[-25:])
        raise RunFailed(f"{case.name}: exit code {process.returncode}; last output:\n{tail}")
    last_line = stdout.strip().splitlines()[-1]
    if case.settings is None:
        return json.loads(last_line)
    # `hetflow train` prints the path of the run's training.json last.
    training = Path(last_line)
    record = {k: v for k, v in json.loads(training.read_text()).items() if k != "history"}
    # Which replicas ran, from the run's cluster.json: evidence the case ran what it says it did.
    cluster = json.loads(RunPaths(training.parents[1]).cluster.read_text())  # training.json is in replica_output/
    record["cluster"] = [f"{r['role']}-{r['index']}" for r in cluster["replicas"]]
    return record


# The rates that copies side by side add up; every other figure is the slower copy's.
SUMMED = (
    "whole_command_examples_per_second",
    "whole_job_examples_per_second",
    "examples_per_second",
    "steady_examples_per_second",
)


def sample(record: dict[str, Any]) -> dict[str, Any]:
    """The figures compared across cases, from one run's record."""
    if "copies" in record:
        copies = [sample(copy) for copy in record["copies"]]
        return {
            **sample({k: v for k, v in record.items() if k != "copies"}),
            **{key: sum(copy[key] for copy in copies) for key in SUMMED},
            "record": record,
        }
    examples_per_epoch = record["steps_per_epoch"] * record["global_batch"]
    examples = record["whole_job_examples_per_second"] * record["whole_job_seconds"]
    return {
        "whole_command_examples_per_second": examples / record["whole_command_seconds"],
        "whole_command_seconds": record["whole_command_seconds"],
        "exit_after_weights_seconds": record["exit_after_weights_seconds"],
        "whole_job_examples_per_second": record["whole_job_examples_per_second"],
        "whole_job_seconds": record["whole_job_seconds"],
        "examples_per_second": record["examples_per_second"],
        "steady_examples_per_second": examples_per_epoch / record["epoch_seconds"][-1],
        "time_to_first_step_seconds": record["time_to_first_step_seconds"],
        **{f"{part}_seconds": seconds for part, seconds in record["whole_job_breakdown"].items()},
        "record": record,
    }


def machine_facts() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu_model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "unknown")
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "memory_gib": round(int(meminfo["MemTotal"].split()[0]) / 2**20, 1),
        "tensorflow": metadata.version("tensorflow"),
        "tf_keras": metadata.version("tf-keras"),
        "python": platform.python_version(),
        "git": commit or "unknown",
    }


def shown(command: list[str]) -> str:
    """A command as one shell line, paths relative to the repository (where it runs)."""
    return shlex.join(os.path.relpath(arg, REPO_ROOT) if arg.startswith("/") else arg for arg in command)


def summarize(
    cases: list[Case], commands: dict[str, list[str]], samples: dict[str, list[dict]], errors: dict[str, str]
) -> dict[str, Any]:
    medians = {
        name: {key: statistics.median(s[key] for s in runs) for key in runs[0] if key != "record"}
        for name, runs in samples.items()
        if runs
    }

    def ratio(name: str, reference: str, rate: str = "whole_command_examples_per_second") -> float | None:
        if name not in medians or reference not in medians:
            return None
        return medians[name][rate] / medians[reference][rate]

    return {
        case.name: {
            "what": case.what,
            "command": shown(commands[case.name]),
            "samples": samples[case.name],
            "median": medians.get(case.name),
            "ratio_to_baseline": ratio(case.name, "baseline"),
            "ratio_to_one_worker": ratio(case.name, "one_worker"),
            "whole_job_ratio_to_one_worker": ratio(case.name, "one_worker", "whole_job_examples_per_second"),
            "error": errors.get(case.name),
        }
        for case in cases
    }


def parse_args() -> tuple[argparse.Namespace, list[Case]]:
    """The command line, and the cases it chose in CASES' order."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated subset of {CASE_NAMES} (default: all but ray_2w, which installs Ray on first use)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; medians are reported")
    # Two epochs, so the last ("steady") epoch is free of the first step's tracing.
    parser.add_argument("--epochs", type=int, default=2, choices=range(2, 101), metavar="N (2-100)")
    parser.add_argument(
        "--steps-per-epoch", type=int, default=200, help="steps per epoch (200: ~30-60 s per run on 2 cores)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    args = parser.parse_args()
    chosen = args.cases.split(",")
    unknown = [name for name in chosen if name not in CASE_NAMES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; cases: {', '.join(CASE_NAMES)}")
    return args, [case for case in CASES if case.name in chosen]


def run_cases(
    cases: list[Case], commands: dict[str, list[str]], args: argparse.Namespace
) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Every case ``args.repeats`` times, interleaved, in a home of its own: each case's samples, and
    the error of each case that failed."""
    samples: dict[str, list[dict]] = {case.name: [] for case in cases}
    errors: dict[str, str] = {}
    # A home of its own, so bench runs leave the user's .hetflow and MLflow store alone.
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-") as home:
        env = {**os.environ, "HETFLOW_HOME": home, "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db"}
        print(f"[bench] preparing {COMMON['dataset']} in {home} ...", flush=True)
        prepare_dataset(env)
        for case in cases:
            if case.peer:
                try:
                    install_peer()
                except RunFailed as exc:
                    errors[case.name] = f"{case.name}: {exc}"
                    print(f"[bench] {errors[case.name]}", file=sys.stderr, flush=True)
        for repeat in range(1, args.repeats + 1):
            for case in cases:
                if case.name in errors:
                    continue  # a case that failed once is not retried: its failure is the result
                print(f"[bench] {case.name} run {repeat}/{args.repeats} ...", flush=True)
                try:
                    result = sample(run_once(case, commands[case.name], env, args.timeout))
                except RunFailed as exc:
                    errors[case.name] = str(exc)
                    print(f"[bench] {exc}", file=sys.stderr, flush=True)
                    continue
                samples[case.name].append(result)
                print(
                    f"[bench] {case.name} run {repeat}/{args.repeats}: "
                    f"{result['whole_command_examples_per_second']:.0f} examples/s whole command "
                    f"({result['whole_command_seconds']:.1f} s), whole job {result['whole_job_seconds']:.1f} s, "
                    f"in epochs {result['examples_per_second']:.0f}",
                    flush=True,
                )
    return samples, errors


def add_comparisons(report: dict[str, Any], samples: dict[str, list[dict]], errors: dict[str, str]) -> None:
    """The report's comparisons with the peer, the two-core ceiling and the loopback socket's bounds;
    a bound that failed to measure goes into ``errors`` as socket_bound."""
    report["peer"] = peer_comparison(report["cases"])
    report["ceiling"] = ceiling_comparison(report["cases"], CEILING_PAIR[0])
    report["ps_ceiling"] = ceiling_comparison(report["cases"], PS_CASE)
    bound_errors = []
    for key, compare in (
        ("collectives", collectives_against_bound),
        ("ps_communication", ps_communication_against_bound),
    ):
        try:
            report[key] = compare(samples)
        except RunFailed as exc:
            bound_errors.append(str(exc))
            print(f"[bench] {exc}", file=sys.stderr, flush=True)
    if bound_errors:
        report["socket_bound_error"] = errors["socket_bound"] = "\n".join(bound_errors)


def main() -> int:
    args, cases = parse_args()
    started_at = datetime.now(timezone.utc)
    # Other work on the machine skews every figure: what kept the cores busy just before the first
    # run, the bench waiting, shows whether some was going on.
    busy_before = busy_cores()
    commands = {case.name: case_command(case, args.epochs, args.steps_per_epoch) for case in cases}
    samples, errors = run_cases(cases, commands, args)
    report = {
        "date": started_at.isoformat(timespec="seconds"),
        "command": shown([sys.executable, "bench/run.py", *sys.argv[1:]]),
        "machine": machine_facts(),
        "busy_cores_before": busy_before,
        "settings": {
            **COMMON,
            "per_worker_batch": PER_WORKER_BATCH,
            "epochs": args.epochs,
            "steps_per_epoch": args.steps_per_epoch,
            "repeats": args.repeats,
        },
        "cases": summarize(cases, commands, samples, errors),
    }
    add_comparisons(report, samples, errors)
    print(save("throughput", report, "RESULTS.md", markdown, at=started_at))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

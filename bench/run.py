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
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from report import save  # bench/report.py: the scripts run as bench/<name>.py

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the virtualenv's bin, where `hetflow` is installed

# What every case shares, passed explicitly to hetflow and to the baseline alike.
COMMON = {"dataset": "synthetic_cifar", "model": "convnet", "optimizer": "adam", "learning_rate": 0.001, "seed": 42}
PER_WORKER_BATCH = 64
# The parts of training.json's whole_job_breakdown, in the order they happen.
BREAKDOWN = ("start_up", "first_step", "steps", "validation", "between_epochs", "shutdown")
# The peer's packages, pinned, installed on first use beside .venv rather than into it (TensorFlow
# and the rest stay .venv's), and put on PYTHONPATH for the peer's case alone.
PEER_LOCK = REPO_ROOT / "bench" / "ray-requirements.lock"
PEER_PACKAGES = REPO_ROOT / ".bench-ray"
# Ours against the peer: (our case, the peer's case), and the aims for the two ratios.
PEER_PAIR = ("mwms_2", "ray_2w")
AIM_EXAMPLES_RATIO = 1.2  # ours / Ray's whole-job examples/s, at least
AIM_FIRST_STEP_RATIO = 0.5  # ours / Ray's time to first step, at most
# Two synchronous workers against the same two workers with nothing to exchange.
CEILING_PAIR = ("mwms_2", "two_apart")
AIM_CEILING_SHARE = 0.9  # of the ceiling's whole-command examples/s, at least
# The case whose all-reduce is held to the bound of the same bytes summed over a socket.
BOUND_CASE = "mwms_2"
AIM_BOUND_RATIO = 3.0  # the case's collective seconds per step / the bound's, at most
# The asynchronous case, held against the same ceiling and its exchange against the same kind of
# bound (the issue states no aim of its own for it: the sync aims are shown beside it).
PS_CASE = "ps_2w_1ps"


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    # hetflow spec keys on top of COMMON and the step counts; None for the cases that are no
    # hetflow run. batch_size is global: PER_WORKER_BATCH times the workers that share one step.
    settings: dict[str, Any] | None
    # For the cases that are no hetflow run: their script under bench/ and its extra arguments.
    script: str | None = None
    script_args: tuple[str, ...] = ()
    # Needs the peer's packages (PEER_LOCK): not run unless asked for, as it may have to download them.
    peer: bool = False
    # Copies of the job run at once, copy i pinned to core i; their examples/s are summed.
    side_by_side: int = 1


CASES = (
    Case("baseline", "plain single-process model.fit, TensorFlow's default threads", None, script="baseline.py"),
    Case(
        "one_worker",
        "hetflow, 1 replica, one_device, 1 thread",
        {"strategy": "one_device", "batch_size": PER_WORKER_BATCH, "replica_threads": 1},
    ),
    Case(
        "mwms_2",
        "hetflow, 2 workers, multi_worker_mirrored, 1 thread each, pinned",
        {
            "strategy": "multi_worker_mirrored",
            "workers": 2,
            "batch_size": 2 * PER_WORKER_BATCH,
            "replica_threads": 1,
            "pin_cores": True,
        },
    ),
    Case(
        "ps_2w_1ps",
        "hetflow, chief + 2 workers + 1 ps, parameter_server (async), 1 thread each, pinned "
        "(the ps on worker-0's core, the chief on worker-1's)",
        # Under parameter_server each step runs on one worker, so its batch is one worker's.
        {
            "strategy": "parameter_server",
            "workers": 2,
            "ps": 1,
            "batch_size": PER_WORKER_BATCH,
            "replica_threads": 1,
            "pin_cores": True,
        },
    ),
    Case(
        "two_apart",
        "two one_worker jobs at once, each pinned to a core of its own, no communication (summed)",
        {"strategy": "one_device", "batch_size": PER_WORKER_BATCH, "replica_threads": 1},
        side_by_side=2,
    ),
    Case(
        "ray_2w",
        "Ray Train TensorflowTrainer, 2 workers, multi_worker_mirrored, 1 thread each, not pinned",
        None,
        script="ray_peer.py",
        script_args=("--workers=2",),
        peer=True,
    ),
)
CASE_NAMES = tuple(case.name for case in CASES)
DEFAULT_CASES = tuple(case.name for case in CASES if not case.peer)


class RunFailed(RuntimeError):
    pass


def _spec_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def case_command(case: Case, epochs: int, steps_per_epoch: int) -> list[str]:
    if case.settings is None:
        return [
            str(BIN / "python"),
            f"bench/{case.script}",
            f"--dataset={COMMON['dataset']}",
            f"--model={COMMON['model']}",
            f"--epochs={epochs}",
            f"--steps-per-epoch={steps_per_epoch}",
            f"--batch-size={PER_WORKER_BATCH}",
            f"--optimizer={COMMON['optimizer']}",
            f"--learning-rate={COMMON['learning_rate']}",
            f"--seed={COMMON['seed']}",
            *case.script_args,
        ]
    settings = {**COMMON, "epochs": epochs, "steps_per_epoch": steps_per_epoch, **case.settings}
    command = [str(BIN / "hetflow"), "train"]
    for key, value in settings.items():
        command += ["--set", f"{key}={_spec_value(value)}"]
    return command


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
    cluster = json.loads((training.parent / "cluster.json").read_text())
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


def socket_bound(size: int, pattern: str) -> dict[str, Any]:
    """bench/socket_bound.py's exchange of ``size`` bytes in ``pattern`` between two pinned processes."""
    command = [str(BIN / "python"), "bench/socket_bound.py", f"--bytes={size}", f"--pattern={pattern}"]
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise RunFailed("socket_bound: no result after 120 s") from None
    if done.returncode != 0:
        raise RunFailed(f"socket_bound: exit code {done.returncode}; last output:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_seconds(runs: list[dict]) -> float | None:
    """The median time of a step after the first (traced) one, over a case's runs."""
    if not runs:
        return None
    return statistics.median(
        run["steps_seconds"] / (run["record"]["steps_per_epoch"] * len(run["record"]["epoch_seconds"]) - 1)
        for run in runs
    )


def against_bound(
    samples: dict[str, list[dict]], case: str, field: str, size_key: str, pattern: str, kept: tuple[str, ...]
) -> dict[str, Any] | None:
    """``case``'s ``field`` of training.json, its seconds per step (median of its runs), against
    ``socket_bound`` of the record's ``size_key`` bytes in ``pattern``, with the record's ``kept``
    keys, when the case ran and recorded it."""
    runs = [s["record"][field] for s in samples.get(case, []) if field in s["record"]]
    if not runs:
        return None
    seconds = statistics.median(run["seconds_per_step"] for run in runs)
    bound = socket_bound(runs[0][size_key], pattern)
    return {
        "case": case,
        "seconds_per_step": seconds,
        "samples": [run["seconds_per_step"] for run in runs],
        **{key: runs[0][key] for key in kept},
        "bound": bound,
        "ratio_to_bound": seconds / bound["seconds"],
    }


def collectives_against_bound(samples: dict[str, list[dict]]) -> dict[str, Any] | None:
    """BOUND_CASE's collectives against the same bytes all-reduced over a socket; beside them, what
    a step of the case took more than a step of the ceiling's (the same workers without an
    all-reduce), where that ran: the all-reduce as the steps pay it."""
    kept = ("bytes_per_step", "collectives_per_step", "dtypes", "implementation", "bytes_per_pack")
    measured = against_bound(samples, BOUND_CASE, "collectives", "bytes_per_step", "all_reduce", kept)
    if measured is None:
        return None
    return {
        **measured,
        "aim": f"<= {AIM_BOUND_RATIO}",
        "step_seconds": step_seconds(samples[BOUND_CASE]),
        "ceiling_step_seconds": step_seconds(samples.get(CEILING_PAIR[1], [])),
    }


def ps_communication_against_bound(samples: dict[str, list[dict]]) -> dict[str, Any] | None:
    """PS_CASE's exchange with the ps against the same bytes sent there and back over a socket."""
    kept = ("bytes_to_worker", "bytes_to_ps", "variables", "measured")
    return against_bound(samples, PS_CASE, "communication", "bytes_to_worker", "round_trip", kept)


def peer_comparison(cases: dict[str, Any]) -> dict[str, Any] | None:
    """Ours against the peer from the medians, when both ran: whole-job examples/s and time to
    first step, ours / Ray's, with the aims they are held to."""
    ours, peer = (cases.get(name, {}).get("median") for name in PEER_PAIR)
    if not ours or not peer:
        return None

    def ratio(key: str) -> float:
        return ours[key] / peer[key]

    return {
        "ours": PEER_PAIR[0],
        "peer": PEER_PAIR[1],
        "whole_job_examples_per_second_ratio": ratio("whole_job_examples_per_second"),
        "whole_job_examples_per_second_aim": f">= {AIM_EXAMPLES_RATIO}",
        "time_to_first_step_ratio": ratio("time_to_first_step_seconds"),
        "time_to_first_step_aim": f"<= {AIM_FIRST_STEP_RATIO}",
    }


def ceiling_comparison(cases: dict[str, Any], case: str) -> dict[str, Any] | None:
    """``case`` against two_apart, the same two single-threaded workers without communication, each
    as a multiple of one_worker (medians of whole-command examples/s), when all three ran; and the
    same over the whole job."""
    ours, apart = cases.get(case, {}), cases.get(CEILING_PAIR[1], {})
    if ours.get("ratio_to_one_worker") is None or apart.get("ratio_to_one_worker") is None:
        return None
    return {
        "case": case,
        "ceiling": CEILING_PAIR[1],
        "case_vs_one_worker": ours["ratio_to_one_worker"],
        "ceiling_vs_one_worker": apart["ratio_to_one_worker"],
        "case_vs_ceiling": ours["ratio_to_one_worker"] / apart["ratio_to_one_worker"],
        "whole_job_case_vs_ceiling": ours["whole_job_ratio_to_one_worker"] / apart["whole_job_ratio_to_one_worker"],
    }


def _number(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    machine, settings = report["machine"], report["settings"]
    lines = [
        "# Benchmark results",
        "",
        f"Training throughput of `model={COMMON['model']}` (≈1.1 M parameters) on `dataset={COMMON['dataset']}` "
        "(generated 32×32×3 images, 10 classes: synthetic data, see `hetflow/data/synthetic_images.py`), "
        f"{PER_WORKER_BATCH} examples per worker per step, {settings['epochs']} epochs × "
        f"{settings['steps_per_epoch']} steps, median of {settings['repeats']} runs per case.",
        "",
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        f"- machine: {machine['nproc']} CPUs ({machine['cpu_model']}), {machine['memory_gib']} GiB memory, "
        f"TensorFlow {machine['tensorflow']}, tf-keras {machine['tf_keras']}, Python {machine['python']}, "
        f"git {machine['git']}",
        f"- 1-minute load average before the first run: {report['load_average_1min_at_start']:.2f}"
        + (" (other work was competing for the cores)" if report["load_average_1min_at_start"] > 0.5 else ""),
        "",
        "| case | what | whole-command examples/s (median) | samples | vs baseline | vs one_worker | "
        "whole-job examples/s | in-epoch examples/s | steady examples/s | time to first step (s) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in report["cases"].items():
        median = result["median"] or {}
        samples = ", ".join(f"{s['whole_command_examples_per_second']:.0f}" for s in result["samples"]) or "–"
        what = result["what"] + (" — **failed**, see below" if result["error"] else "")
        lines.append(
            f"| {name} | {what} | {_number(median.get('whole_command_examples_per_second'))} | {samples} | "
            f"{_number(result['ratio_to_baseline'], 2)} | {_number(result['ratio_to_one_worker'], 2)} | "
            f"{_number(median.get('whole_job_examples_per_second'))} | "
            f"{_number(median.get('examples_per_second'))} | {_number(median.get('steady_examples_per_second'))} | "
            f"{_number(median.get('time_to_first_step_seconds'), 1)} |"
        )
    lines += [
        "",
        "Where the whole command's time went (medians, seconds; the samples' range in brackets):",
        "",
        "| case | whole command | whole job | "
        + " | ".join(part.replace("_", " ") for part in BREAKDOWN)
        + " | exit after weights |",
        "|---|---:|---:|" + "---:|" * (len(BREAKDOWN) + 1),
    ]

    def seconds(result: dict[str, Any], key: str) -> str:
        values = [sample[key] for sample in result["samples"]]
        if not values:
            return "–"
        spread = f" [{min(values):.1f}–{max(values):.1f}]" if len(values) > 1 else ""
        return f"{statistics.median(values):.1f}{spread}"

    for name, result in report["cases"].items():
        parts = " | ".join(seconds(result, f"{part}_seconds") for part in BREAKDOWN)
        lines.append(
            f"| {name} | {seconds(result, 'whole_command_seconds')} | {seconds(result, 'whole_job_seconds')} | "
            f"{parts} | {seconds(result, 'exit_after_weights_seconds')} |"
        )
    peer = report.get("peer")
    if peer:
        examples, first_step = peer["whole_job_examples_per_second_ratio"], peer["time_to_first_step_ratio"]
        lines += [
            "",
            f"Against a peer, {peer['ours']} / {peer['peer']} (Ray Train, the same job; medians):",
            "",
            "| | ours / Ray's | aim | met |",
            "|---|---:|---:|---|",
            f"| whole-job examples/s | {examples:.2f}× | ≥ {AIM_EXAMPLES_RATIO}× | "
            f"{'yes' if examples >= AIM_EXAMPLES_RATIO else 'no'} |",
            f"| time to first step | {first_step:.2f}× | ≤ {AIM_FIRST_STEP_RATIO}× | "
            f"{'yes' if first_step <= AIM_FIRST_STEP_RATIO else 'no'} |",
            "",
            "ray_2w (bench/ray_peer.py) runs mwms_2's job with Ray's own machinery: the same model, data, "
            "per-worker batch, steps and per-epoch validation, trained with `model.fit` as Ray's guides do, "
            "timed by the same clock from its launch "
            "(`ray.init` and the trainer's start included) to rank 0's final weights written. Where it "
            "differs: its workers are not pinned to cores (Ray's CPUs are logical: it sets no affinity); "
            "its per-epoch checkpoint is Ray's (every worker writes model and optimizer, `ray.train.report` "
            "persists rank 0's) where hetflow's chief alone writes them; its whole job ends at the weights, as "
            "ours does, not when `fit()` returns (`fit_returned_after_seconds` in the JSON).",
        ]
    ceiling = report.get("ceiling")
    if ceiling:
        lines += [
            "",
            f"Two workers against what two cores give here: {ceiling['ceiling']} (one_worker's job twice at once, "
            f"a core each, no communication) reaches {ceiling['ceiling_vs_one_worker']:.2f}× one_worker's "
            f"whole-command examples/s; {ceiling['case']} reaches {ceiling['case_vs_one_worker']:.2f}×, "
            f"**{ceiling['case_vs_ceiling']:.2f} of that ceiling** (the rest is the all-reduce and the lockstep; "
            f"over the whole job {ceiling['whole_job_case_vs_ceiling']:.2f}); the aim is at least "
            f"{AIM_CEILING_SHARE}: {'met' if ceiling['case_vs_ceiling'] >= AIM_CEILING_SHARE else '**not met**'}.",
        ]
    ps_ceiling = report.get("ps_ceiling")
    if ps_ceiling:
        share = ps_ceiling["case_vs_ceiling"]
        lines += [
            "",
            f"Asynchronous workers against the same ceiling: {ps_ceiling['case']} "
            f"({report['cases'][ps_ceiling['case']]['what']}; each step one worker's batch, applied on the ps) reaches "
            f"{ps_ceiling['case_vs_one_worker']:.2f}× one_worker's whole-command examples/s, **{share:.2f} of "
            f"{ps_ceiling['ceiling']}'s {ps_ceiling['ceiling_vs_one_worker']:.2f}×** (over the whole job "
            f"{ps_ceiling['whole_job_case_vs_ceiling']:.2f}; the sync aim of at least {AIM_CEILING_SHARE} would be "
            f"{'met' if share >= AIM_CEILING_SHARE else '**not met**'}).",
        ]
    collectives = report.get("collectives")
    if collectives:
        bound, ratio = collectives["bound"], collectives["ratio_to_bound"]
        runs = ", ".join(f"{1000 * seconds:.1f}" for seconds in collectives["samples"])
        what = (
            f"{collectives['bytes_per_step']} bytes ({', '.join(collectives['dtypes'])}) in "
            f"{collectives['collectives_per_step']} collective(s) ({collectives['implementation']}, "
            f"bytes_per_pack {collectives['bytes_per_pack']})"
        )
        lines += [
            "",
            f"{collectives['case']}'s all-reduce per step, timed alone by its workers before their first step: "
            f"**{1000 * collectives['seconds_per_step']:.1f} ms** (median of its runs' {runs}) for {what}; "
            "the same bytes all-reduced by two processes over a loopback socket, a core each "
            f"(bench/socket_bound.py, {bound['bytes_sent_per_process']} bytes sent by each): "
            f"{1000 * bound['seconds']:.1f} ms [{1000 * bound['seconds_min']:.1f}–{1000 * bound['seconds_max']:.1f}]; "
            f"**{ratio:.1f}× that bound**, the aim is at most {AIM_BOUND_RATIO:.0f}×: "
            f"{'met' if ratio <= AIM_BOUND_RATIO else '**not met**'}.",
        ]
        if collectives["ceiling_step_seconds"]:
            step, ceiling_step = collectives["step_seconds"], collectives["ceiling_step_seconds"]
            lines[-1] += (
                f" In its steps: {1000 * step:.1f} ms per step against {1000 * ceiling_step:.1f} ms for "
                f"{CEILING_PAIR[1]}'s (no all-reduce), {1000 * (step - ceiling_step):.1f} ms more."
            )
    communication = report.get("ps_communication")
    if communication:
        bound, ratio = communication["bound"], communication["ratio_to_bound"]
        runs = ", ".join(f"{1000 * seconds:.1f}" for seconds in communication["samples"])
        lines += [
            "",
            f"{communication['case']}'s communication per step, timed alone through the coordinator before the "
            f"first step: **{1000 * communication['seconds_per_step']:.1f} ms** (median of its runs' {runs}) for "
            f"{communication['bytes_to_worker']} bytes of {communication['variables']} variables read onto a worker "
            f"and {communication['bytes_to_ps']} bytes of update sent back to the ps "
            "(hetflow/replica/ps_exchange.py); the same bytes sent there and back between two processes over a "
            f"loopback socket, a core each (bench/socket_bound.py --pattern {bound['pattern']}): "
            f"{1000 * bound['seconds']:.1f} ms [{1000 * bound['seconds_min']:.1f}–{1000 * bound['seconds_max']:.1f}]; "
            f"**{ratio:.1f}× that bound** (the sync aim of at most {AIM_BOUND_RATIO:.0f}× would be "
            f"{'met' if ratio <= AIM_BOUND_RATIO else '**not met**'}).",
        ]
    lines += [
        "",
        "whole command: from the command's start to its exit (copies side by side: the last one's); "
        "whole job: from the same start to the final weights written; start up: the start to the first epoch "
        "(process, imports, cluster, model, input pipeline); first step: its tracing; between epochs: "
        "checkpoints; shutdown: last epoch to weights written. in-epoch: examples over the time in epochs "
        "(validation included). steady: the last epoch alone. Absolute numbers vary between machines; "
        "ratios measured in one run are what counts.",
        "",
        "Each case's command (with `HETFLOW_HOME` and `MLFLOW_TRACKING_URI` in a temporary directory):",
        "",
    ]
    lines += [f"- {name}: `{result['command']}`" for name, result in report["cases"].items()]
    for name, result in report["cases"].items():
        if result["error"]:
            lines += ["", f"{name} failed:", "", "```", result["error"], "```"]
    if report.get("socket_bound_error"):
        lines += ["", "socket_bound failed:", "", "```", report["socket_bound_error"], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
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
    cases = [case for case in CASES if case.name in chosen]

    started_at = datetime.now(timezone.utc)
    # Other work on the machine skews every figure; the load before the first run shows whether
    # some was going on (later samples would count the bench's own runs).
    load_at_start = os.getloadavg()[0]
    commands = {case.name: case_command(case, args.epochs, args.steps_per_epoch) for case in cases}
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

    report = {
        "date": started_at.isoformat(timespec="seconds"),
        "command": shown([sys.executable, "bench/run.py", *sys.argv[1:]]),
        "machine": machine_facts(),
        "load_average_1min_at_start": load_at_start,
        "settings": {
            **COMMON,
            "per_worker_batch": PER_WORKER_BATCH,
            "epochs": args.epochs,
            "steps_per_epoch": args.steps_per_epoch,
            "repeats": args.repeats,
        },
        "cases": summarize(cases, commands, samples, errors),
    }
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
    print(save("throughput", report, "RESULTS.md", markdown(report), at=started_at))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

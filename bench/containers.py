"""``make bench``: what running the replicas in containers costs. The same 2-worker sync job
(multi_worker_mirrored, the benchmark convnet on generated CIFAR-shaped data, one TensorFlow thread
per worker, each worker on a core of its own) on ``backend=local``, ``backend=docker`` and
``backend=swarm``; the cases differ in the backend only. The swarm is two Docker-in-Docker nodes of
1.0 CPU each, one worker per node, brought up by docker/swarm.sh (``make swarm``'s) for the bench
and removed after it: Swarm cannot pin a core, so there a worker's core of its own is its node's
CPU quota.

Figures per run, from the run's own files:
- launch to weights (the headline): examples trained / seconds from ``hetflow train``'s start
  (spec, preflight, the cluster) to the final weights written, as training.json's clock records it;
- whole-job examples/s from the layout: the same from the chief's launch (its keeper or container
  start), as training.json records it;
- time to first step: from a replica's launch (its keeper or container start) to the end of its
  first training step, as the replica records it;
- in-epoch examples/s, as training.json records it, beside them.
Cases alternate run by run; medians over ``--repeats`` runs; the ratios docker / local and
swarm / local are computed from the medians of this one bench run.

Writes bench/results/containers-<UTC timestamp>.json and bench/CONTAINERS.md.

    python bench/containers.py [--repeats 3] [--steps-per-epoch 100] [--backends local,docker,swarm]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from report import save  # bench/report.py: the scripts run as bench/<name>.py
from run import machine_facts, prepare_dataset, shown
from swarm_nodes import left_on_engine, node_cpus, swarm
from throughput_cases import BIN, COMMON, PER_WORKER_BATCH, REPO_ROOT

BACKENDS = ("local", "docker", "swarm")
# Equal nodes: the swarm case differs from the others in the backend only.
SWARM_NODES = "node-1:1.0:cpu node-2:1.0:cpu"
# One worker per node; this machine's kernel has no IPsec ESP for an encrypted overlay
# (tests/test_cluster_swarm_backend.py).
SWARM_SETTINGS = {
    "pin_cores": "false",
    "worker_devices": '[{"node": "node-1"}, {"node": "node-2"}]',
    "encrypt_network": "false",
}


def command(backend: str, epochs: int, steps_per_epoch: int) -> list[str]:
    settings = {
        **COMMON,
        "strategy": "multi_worker_mirrored",
        "workers": 2,
        "batch_size": 2 * PER_WORKER_BATCH,
        "replica_threads": 1,
        "pin_cores": "true",  # local: taskset; docker: the container's cpuset
        "epochs": epochs,
        "steps_per_epoch": steps_per_epoch,
        "backend": backend,
        **(SWARM_SETTINGS if backend == "swarm" else {}),
    }
    args = [str(BIN / "hetflow"), "train"]
    for key, value in settings.items():
        args += ["--set", f"{key}={value}"]
    return args


def run_once(backend: str, args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    command_started_at = time.time()
    done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"{backend}: exit code {done.returncode}; last output:\n{tail}")
    record = json.loads(Path(done.stdout.strip().splitlines()[-1]).read_text())  # `hetflow train` prints its path last
    examples = record["epochs_done"] * record["steps_per_epoch"] * record["global_batch"]
    command_to_weights = record["weights_written_at"] - command_started_at
    return {
        "command_to_weights_seconds": command_to_weights,
        "command_examples_per_second": examples / command_to_weights,
        "whole_job_seconds": record["whole_job_seconds"],
        "whole_job_examples_per_second": record["whole_job_examples_per_second"],
        "in_epoch_examples_per_second": record["examples_per_second"],
        "time_to_first_step_seconds": record["time_to_first_step_seconds"],
        "examples": examples,
    }


def markdown(report: dict[str, Any]) -> str:
    machine, settings, cases = report["machine"], report["settings"], report["cases"]
    backends = list(cases)
    named = " and ".join([", ".join(backends[:-1]), backends[-1]] if len(backends) > 1 else backends)
    lines = [
        f"# Containers: the same job on the {named} backend{'s' if len(backends) > 1 else ''}",
        "",
        f"`model={COMMON['model']}` on `dataset={COMMON['dataset']}` (generated data), multi_worker_mirrored, "
        f"2 workers × {PER_WORKER_BATCH} examples per step, one thread each, one core each, "
        f"{settings['epochs']} epochs × {settings['steps_per_epoch']} steps; median of {settings['repeats']} "
        "runs per backend, the backends alternating.",
        "",
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        f"- machine: {machine['nproc']} CPUs ({machine['cpu_model']}), {machine['memory_gib']} GiB, "
        f"TensorFlow {machine['tensorflow']}, git {machine['git']}; Docker engine {report['docker_engine']}",
        f"- replica image: {report['image']}",
    ]
    if "swarm" in cases:
        quotas = ", ".join(f"{node} {cpus:g} CPU" for node, cpus in report["swarm_nodes"].items())
        lines += [
            f"- swarm: {len(report['swarm_nodes'])} Docker-in-Docker nodes on this machine ({quotas}), one worker "
            "on each, brought up by `docker/swarm.sh up` before the first run and removed after the last "
            f"(left on the engine afterwards: {', '.join(report['swarm_left']) or 'nothing'}); their engines idle "
            "beside the local and docker runs",
            "- what differs between the cases is the backend only, and with it how a worker gets its core: local "
            "pins its process (taskset), docker its container (cpuset), swarm cannot pin and bounds each worker by "
            "its node's CPU quota (equal quotas, so the nodes are alike)",
        ]
    lines += [
        "",
        "| backend | launch to weights: examples/s | runs | s | from the layout: examples/s | s "
        "| time to first step (s) | runs | in-epoch examples/s |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for backend in backends:
        runs = cases[backend]["samples"]
        median = cases[backend]["median"]
        if not median:
            lines.append(f"| {backend} | – | failed: see below | – | – | – | – | | – |")
            continue
        throughputs = ", ".join(f"{r['command_examples_per_second']:.0f}" for r in runs)
        first_steps = ", ".join(f"{r['time_to_first_step_seconds']:.1f}" for r in runs)
        lines.append(
            f"| {backend} | {median['command_examples_per_second']:.0f} | {throughputs} | "
            f"{median['command_to_weights_seconds']:.1f} | {median['whole_job_examples_per_second']:.0f} | "
            f"{median['whole_job_seconds']:.1f} | {median['time_to_first_step_seconds']:.1f} | {first_steps} | "
            f"{median['in_epoch_examples_per_second']:.0f} |"
        )
    for backend, ratios in report["vs_local"].items():
        lines += [
            "",
            f"{backend} / local, examples/s from launch to weights: **{ratios['command_throughput']:.2f}x**, "
            f"from the layout: {ratios['whole_job_throughput']:.2f}x (goal ≥ 0.9x); "
            f"time to first step: {backend} {ratios['first_step_extra_seconds']:+.1f} s vs local (goal ≤ +5 s).",
        ]
    lines += [
        "",
        "Launch to weights (the headline): from `hetflow train`'s start (spec, preflight, the cluster) to the "
        "final weights written; from the layout: from the cluster layout written just before the replicas are "
        "started to the final weights, as training.json's whole_job_seconds. "
        "Time to first step: from each replica's launch (keeper process or container "
        "start) to the end of its first training step.",
    ]
    for backend in backends:
        if cases[backend]["error"]:
            lines += ["", f"{backend} failed:", "", "```", cases[backend]["error"], "```"]
    return "\n".join(lines) + "\n"


def _engine_and_image() -> tuple[str, str]:
    import docker

    client = docker.from_env()
    image = client.images.get("hetflow-replica:0.1.0")
    return client.version()["Version"], f"hetflow-replica:0.1.0, {image.attrs['Size'] / 1e6:.0f} MB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps-per-epoch", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset")
    args = parser.parse_args()
    backends = args.backends.split(",")
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        parser.error(f"--backends={','.join(unknown)} is invalid: expected a subset of {','.join(BACKENDS)}")
    engine, image = _engine_and_image()
    started_at = datetime.now(timezone.utc)
    commands = {b: command(b, args.epochs, args.steps_per_epoch) for b in backends}
    samples: dict[str, list] = {b: [] for b in backends}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-") as home:
        env = {**os.environ, "HETFLOW_HOME": home, "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db"}
        env.pop("DOCKER_HOST", None)  # local and docker: this machine's engine
        prepare_dataset(env)
        with swarm(env, SWARM_NODES) if "swarm" in backends else nullcontext(None) as swarm_env:
            envs = {b: swarm_env if b == "swarm" else env for b in backends}
            for repeat in range(1, args.repeats + 1):
                for backend in backends:
                    if backend in errors:
                        continue
                    try:
                        result = run_once(backend, commands[backend], envs[backend], args.timeout)
                    except (RuntimeError, subprocess.TimeoutExpired) as error:
                        errors[backend] = str(error)
                        continue
                    samples[backend].append(result)
                    print(
                        f"[bench] {backend} run {repeat}: {result['command_examples_per_second']:.0f} examples/s "
                        f"launch to weights, first step after {result['time_to_first_step_seconds']:.1f} s",
                        flush=True,
                    )
                    time.sleep(2)  # let the last run's processes and sockets go
    medians = {
        b: {key: statistics.median(s[key] for s in runs) for key in runs[0]} if runs else None
        for b, runs in samples.items()
    }
    local = medians.get("local")
    vs_local = {
        b: {
            "command_throughput": median["command_examples_per_second"] / local["command_examples_per_second"],
            "whole_job_throughput": median["whole_job_examples_per_second"] / local["whole_job_examples_per_second"],
            "first_step_extra_seconds": median["time_to_first_step_seconds"] - local["time_to_first_step_seconds"],
        }
        for b, median in medians.items()
        if b != "local" and local and median
    }
    report = {
        "date": started_at.isoformat(timespec="seconds"),
        "command": shown([sys.executable, "bench/containers.py", *sys.argv[1:]]),
        "machine": machine_facts(),
        "docker_engine": engine,
        "image": image,
        "settings": {**COMMON, "epochs": args.epochs, "steps_per_epoch": args.steps_per_epoch, "repeats": args.repeats},
        "cases": {
            b: {"command": shown(commands[b]), "samples": samples[b], "median": medians[b], "error": errors.get(b)}
            for b in backends
        },
        "vs_local": vs_local,
    }
    if "swarm" in backends:
        report |= {"swarm_nodes": node_cpus(SWARM_NODES), "swarm_left": left_on_engine()}
    print(save("containers", report, "CONTAINERS.md", markdown, at=started_at))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

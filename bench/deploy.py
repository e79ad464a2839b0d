"""``make bench`` (deployment part, #56): the endpoint of ``hetflow serve`` on loopback, in a real
MLflow store, real HAProxy and sandboxed model servers, measured as its users would meet it.

In order, on one endpoint (one replica per version) unless said:

1. capacity: a closed loop (client processes sending back-to-back, a new connection per request,
   one instance per request) through the endpoint, and the same loop straight to its model
   server's Unix socket (the one difference: HAProxy in between);
2. a steady open-loop load at about half that capacity (tests/serving_load.py), its p50/p99;
3. ``--swaps`` champion swaps in a row under that load, each to a newly registered version (two
   models' files, alternating): failed requests, p99 during each swap, the time from the alias
   moving to all traffic on the new version and where it goes (the rollout record's steps), the
   endpoint's memory (RSS of HAProxy and the model servers, sampled) around each swap;
4. two bad candidates under the same load, each a real model misbehaving (tests/serving_models.py):
   one failing on 5% of the inputs, one about 3x slower (its loop calibrated here): the time from
   the canary's first traffic, and from the fault showing, to the rollback, and ``champion`` back;
5. a second endpoint with two replicas, the same closed loop (the one difference: replicas);
6. ``mlflow models serve`` alone on the same version (MLflow's scoring server), the same closed loop
   on ``/invocations`` as the endpoint's ``/invocations``.

Writes bench/results/deploy-<UTC timestamp>.json and bench/DEPLOY.md (from the JSON; ``--render
JSON`` rewrites it).

    make bench-deploy
    .venv/bin/python bench/deploy.py --swaps 3
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import logging
import os
import shlex
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import yaml
from deploy_load import (
    MODEL,
    LoadProcess,
    MemorySampler,
    closed_loop,
    closed_loop_worker,
    latency_figures,
    open_loop_worker,
)
from deploy_report import SLOW_FACTOR, markdown, summarize
from deploy_swaps import ROLLOUT_DEADLINE_SECONDS, bad_candidate, swap_once
from report import busy_cores, save  # bench/report.py: the scripts run as bench/<name>.py
from run import machine_facts

PREDICT_PATH = f"/v1/models/{MODEL}:predict"


@contextlib.contextmanager
def serving(uri: str, folder: Path, replicas: int, limits):
    """An endpoint serving ``MODEL``'s champion, in a thread that lives as long as its servers; each
    rollout's record and the moment it began kept on ``endpoint.rollouts``."""
    from hetflow.serving.endpoint import Endpoint
    from hetflow.serving.server import free_port

    class RecordedEndpoint(Endpoint):
        def _roll_out(self, move):
            began = time.monotonic()
            super()._roll_out(move)
            self.rollouts.append((began, self._last_record))

        def _write_record(self, rollout):
            self._last_record = rollout.record  # the Rollout's record: its steps, figures, outcome
            super()._write_record(rollout)

    endpoint = RecordedEndpoint(uri, folder, port=free_port(), replicas=replicas, limits=limits)
    endpoint.rollouts = []
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=endpoint.serve, args=(stop, ready))
    thread.start()
    try:
        if not ready.wait(ROLLOUT_DEADLINE_SECONDS):
            raise SystemExit("the endpoint did not serve its first champion in time")
        yield endpoint
    finally:
        stop.set()
        thread.join(60)


def build_registry(root: Path) -> dict:
    """The store: two healthy models' files (versions alternate between them), one failing on 5%
    of inputs; version 1 champion."""
    from serving_models import register, save_version

    from hetflow.registry import store

    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = store.client(uri)
    for name, seed, fault in (("a", 3, None), ("b", 4, None), ("errors", 5, "errors")):
        save_version(root / name, seed, fault=fault, failing_share=0.05)
    register(client, MODEL, root / "a")
    client.set_registered_model_alias(MODEL, "champion", "1")
    return {"uri": uri, "client": client, "root": root}


def loop_milliseconds(root: Path) -> float:
    """What one iteration of the slow model's loop costs, timed in this process on one thread (as a
    model server computes: ``--threads 1``): a 3000-iteration version against the healthy one."""
    import tensorflow as tf
    from serving_models import sample_images, save_version

    save_version(root / "probe", 6, fault="slow", slow_loop=3000)
    image = tf.constant(sample_images(1))

    def call_ms(folder: Path) -> float:
        saved = yaml.safe_load((folder / "MLmodel").read_text())["flavors"]["tensorflow"]["saved_model_dir"]
        signature = tf.saved_model.load(str(folder / saved)).signatures["serving_default"]
        for _ in range(3):
            signature(image=image)
        times = []
        for _ in range(15):
            began = time.perf_counter()
            signature(image=image)
            times.append((time.perf_counter() - began) * 1000)
        return float(np.median(times))

    return (call_ms(root / "probe") - call_ms(root / "a")) / 3000


@contextlib.contextmanager
def mlflow_scoring_server(model_dir: Path, log_path: Path):
    """What ``mlflow models serve -m MODEL_DIR -w 1`` runs (MLflow's scoring server, one worker) on
    127.0.0.1, unsandboxed as a user runs it; its port once ``/ping`` answers."""
    from hetflow.serving.server import free_port, launch, scoring_command, stop_group, wait_until_healthy

    port = free_port()
    command, env = scoring_command(model_dir, port)
    process = launch(command, {"confined": False}, log_path, env, read_write=[], read_only=[])
    try:
        wait_until_healthy(
            process,
            lambda timeout: http.client.HTTPConnection("127.0.0.1", port, timeout=timeout),
            time.monotonic() + ROLLOUT_DEADLINE_SECONDS,
            lambda: log_path.read_text(errors="replace")[-1500:],
        )
        yield port
    finally:
        stop_group(process, "mlflow models serve")


# ---- the phases ----


def capacity_phase(endpoint, bodies: list[str], seconds: float, folder: Path) -> dict:
    """Closed loops on one replica: through the endpoint, straight to its model server, and on
    ``/invocations`` through the endpoint and through ``mlflow models serve`` on the same files."""
    port, servers = endpoint.balancer.port, endpoint.serving[MODEL][1]
    results = {
        "endpoint": closed_loop({"port": port, "path": PREDICT_PATH}, bodies, seconds),
        "direct": closed_loop({"unix": str(servers.sockets[0]), "path": PREDICT_PATH}, bodies, seconds),
        "endpoint_invocations": closed_loop({"port": port, "path": "/invocations"}, bodies, seconds),
    }
    with mlflow_scoring_server(servers.model_dir, folder / "mlflow-serve.log") as mlflow_port:
        results["mlflow_invocations"] = closed_loop({"port": mlflow_port, "path": "/invocations"}, bodies, seconds)
    return results


def rollout_phase(endpoint, registry, rate: float, args, loop_ms: float) -> dict:
    """Under one steady load: its first seconds, the swaps, then the two bad candidates. The steady
    figures are the load's answers outside the swaps before the bad candidates (its first seconds and
    the pauses between swaps): on a shared machine, other work's bursts then weigh on both sides alike."""
    from serving_models import save_version

    root = registry["root"]
    with MemorySampler() as memory, LoadProcess(endpoint.balancer.port, rate) as load:
        time.sleep(args.steady_seconds)
        first = latency_figures(list(load.answers))
        swaps, windows = [], []
        budget_end = time.monotonic() + args.swap_budget
        for index in range(args.swaps):
            moved = time.monotonic()
            if swaps and moved + max(swap["seconds_to_recorded"] for swap in swaps) > budget_end:
                break  # the bench's time bound: the swaps done are reported as fewer than asked
            swaps.append(swap_once(endpoint, registry, load, memory, root / ("b", "a")[index % 2]))
            windows.append((moved, moved + swaps[-1]["seconds_to_recorded"]))
        steady_end = time.monotonic()
        steady = latency_figures(
            [
                a
                for a in load.answers
                if a.sent < steady_end and not any(start <= a.sent < end for start, end in windows)
            ]
        )
        slow_loop = max(1, round((SLOW_FACTOR - 1) * steady["p50_ms"] / loop_ms))
        save_version(root / "slow", 6, fault="slow", slow_loop=slow_loop)  # between swaps: nothing measured
        errors = bad_candidate(endpoint, registry, load, root / "errors")
        slow = bad_candidate(endpoint, registry, load, root / "slow")
    pooled = [answer for answer in load.answers if any(start <= answer.sent < end for start, end in windows)]
    return {
        "rate_per_second": rate,
        "steady": steady,
        "first_seconds": first,
        "during_swaps": latency_figures(pooled),
        "load": latency_figures(load.answers),
        "swaps": swaps,
        "bad_candidates": {"errors": errors, "slow": slow},
        "slow_loop": {"iterations": slow_loop, "iteration_ms": round(loop_ms, 5), "base_p50_ms": steady["p50_ms"]},
    }


class Phases:
    """How long each phase of the bench took (its log says which is running)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def run(self, name: str, function, *arguments):
        logging.getLogger("bench.deploy").info("%s ...", name)
        began = time.monotonic()
        result = function(*arguments)
        self.seconds[name] = round(time.monotonic() - began, 1)
        return result

    @contextlib.contextmanager
    def entered(self, name: str, context):
        logging.getLogger("bench.deploy").info("%s ...", name)
        began = time.monotonic()
        with context as value:
            self.seconds[name] = round(time.monotonic() - began, 1)
            yield value


def measure(args) -> dict:
    """Every phase in a fresh store under a temporary HETFLOW_HOME; the record's figures."""
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-deploy-") as home:
        os.environ.update(HETFLOW_HOME=home, MLFLOW_TRACKING_URI=f"sqlite:///{home}/mlflow.db")
        import hetflow  # noqa: F401  - before TensorFlow: the package sets TF_USE_LEGACY_KERAS

        root = Path(home)
        phases = Phases()
        import tensorflow as tf
        from serving_models import load_images

        from hetflow.serving import policy

        tf.config.threading.set_intra_op_parallelism_threads(1)  # as a model server computes (--threads 1)
        registry = phases.run("registry", build_registry, root)
        loop_ms = phases.run("slow_loop_timing", loop_milliseconds, root)
        bodies = [json.dumps({"instances": [image]}) for image in load_images(40)]
        limits = policy.Limits(step_seconds=args.step_seconds)
        with phases.entered("endpoint_start", serving(registry["uri"], root / "e1", 1, limits)) as endpoint:
            capacity = phases.run("capacity", capacity_phase, endpoint, bodies, args.closed_seconds, root)
            rate = round(capacity["endpoint"]["requests_per_second"] / 2, 1)
            rollouts = phases.run("rollouts", rollout_phase, endpoint, registry, rate, args, loop_ms)
        registry["client"].set_registered_model_alias(MODEL, "champion", "1")  # the version measured above
        with phases.entered("endpoint_2_replicas_start", serving(registry["uri"], root / "e2", 2, limits)) as endpoint:
            target = {"port": endpoint.balancer.port, "path": PREDICT_PATH}
            capacity["endpoint_2_replicas"] = phases.run(
                "capacity_2_replicas", closed_loop, target, bodies, args.closed_seconds
            )
    return {
        "phase_seconds": phases.seconds,
        "limits": {
            "steps": list(limits.steps),
            "step_seconds": limits.step_seconds,
            "min_requests": limits.min_requests,
            "max_error_rate": limits.max_error_rate,
            "max_p99_ratio": limits.max_p99_ratio,
            "p99_floor_ms": limits.p99_floor_ms,
        },
        "default_step_seconds": policy.Limits().step_seconds,
        "capacity": capacity,
        **rollouts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swaps", type=int, default=20)
    parser.add_argument("--step-seconds", type=float, default=2.0, help="each canary step's least duration")
    parser.add_argument("--closed-seconds", type=float, default=8.0, help="each closed loop's duration")
    parser.add_argument("--steady-seconds", type=float, default=10.0, help="the steady load before the swaps")
    parser.add_argument(
        "--swap-budget", type=float, default=480.0, help="seconds for the swaps: no swap starts that would pass it"
    )
    parser.add_argument("--render", metavar="JSON", help="only rewrite DEPLOY.md from this results file")
    parser.add_argument("--closed-loop-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--open-loop-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.open_loop_worker:
        open_loop_worker(json.loads(sys.stdin.readline()))
        return
    if args.closed_loop_worker:
        print(json.dumps(closed_loop_worker(json.loads(sys.stdin.read()))))
        return
    if args.render:
        record = json.loads(Path(args.render).read_text())
        record.setdefault("summary", summarize(record))
        Path(__file__).with_name("DEPLOY.md").write_text(markdown(record))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"  # the versions' copies, 25 times
    started, machine = time.monotonic(), machine_facts()
    shared = {"load_average": [round(value, 2) for value in os.getloadavg()], "busy_cores": round(busy_cores(), 2)}
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([".venv/bin/python", "bench/deploy.py", *sys.argv[1:]]),
        "machine": f"{machine['nproc']} CPUs, {machine['cpu_model']}, {machine['memory_gib']} GiB, "
        f"TensorFlow {machine['tensorflow']}, Python {machine['python']}",
        "git_at_start": machine["git"],
        "at_start": shared,
        "swaps_asked": args.swaps,
        "swap_budget_seconds": args.swap_budget,
        **measure(args),
    }
    record["git_at_end"] = machine_facts()["git"]
    record["wall_seconds"] = round(time.monotonic() - started, 1)
    kept = Path(tempfile.gettempdir(), "hetflow-bench-deploy-record.json")
    kept.write_text(json.dumps(record))  # the measurements survive a summary that fails: --render it after a fix
    record["summary"] = summarize(record)
    save("deploy", record, "DEPLOY.md", markdown)


if __name__ == "__main__":
    main()

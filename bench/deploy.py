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
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import yaml
from report import busy_cores, save  # bench/report.py: the scripts run as bench/<name>.py
from run import machine_facts

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))  # the endpoint's tests' models and load, shared with them
MODEL = "digits"
PREDICT_PATH = f"/v1/models/{MODEL}:predict"
ROLLOUT_DEADLINE_SECONDS = 120.0
SLOW_FACTOR = 3.0
MEMORY_SLACK = 1.15
SETTLE_SECONDS = 1.5  # between swaps
FIRST_ANSWERS = 20


# ---- load ----


def closed_loop_worker(spec: dict) -> dict:
    """In a client process: ``threads`` threads each sending back-to-back from ``start_at`` (wall
    time) for ``seconds``; each answer's latency (ms) and the failures; this process's CPU seconds."""
    from hetflow.serving.server import UnixHTTPConnection

    bodies = [body.encode() for body in spec["bodies"]]
    stop_at = spec["start_at"] + spec["seconds"]
    latencies, failures = [], [0]

    def connect():
        if "unix" in spec:
            return UnixHTTPConnection(Path(spec["unix"]), 30)
        return http.client.HTTPConnection("127.0.0.1", spec["port"], timeout=30)

    def send(offset: int) -> None:
        sent = offset
        while time.time() < stop_at:
            body, sent = bodies[sent % len(bodies)], sent + 1
            began = time.perf_counter()
            connection = connect()
            try:
                connection.request("POST", spec["path"], body=body, headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                response.read()
                ok = response.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
            finally:
                connection.close()
            if ok:
                latencies.append((time.perf_counter() - began) * 1000)
            else:
                failures[0] += 1

    time.sleep(max(0.0, spec["start_at"] - time.time()))
    cpu = time.process_time()
    threads = [threading.Thread(target=send, args=(i * 7,)) for i in range(spec["threads"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"latencies_ms": latencies, "failures": failures[0], "cpu_seconds": time.process_time() - cpu}


def open_loop_worker(spec: dict) -> None:
    """In a load process: tests/serving_load.py's steady load until stdin closes, each answer a line
    on stdout as it comes (``sent status version seconds``; ``sent`` on the system's monotonic clock,
    which the bench reads too). Apart from the endpoint's controller, whose work in the bench's
    process would otherwise hold the load's threads back (one GIL) and count as the endpoint's latency."""
    from serving_load import SteadyLoad
    from serving_models import load_images

    with SteadyLoad(spec["port"], MODEL, load_images(), spec["rate"]) as load:
        closed = threading.Thread(target=sys.stdin.read, daemon=True)
        closed.start()
        written = 0
        while closed.is_alive():
            closed.join(0.2)
            written = _write_answers(load.answers, written)
    _write_answers(load.answers, written)


def _write_answers(answers: list, written: int) -> int:
    fresh = answers[written:]
    sys.stdout.write("".join(f"{a.sent} {a.status} {a.version or '-'} {a.seconds}\n" for a in fresh))
    sys.stdout.flush()
    return written + len(fresh)


class LoadProcess:
    """The steady open-loop load in a process of its own; ``answers`` fill as it reports them."""

    def __init__(self, port: int, rate: float):
        self.spec = {"port": port, "rate": rate}
        self.answers: list = []

    def __enter__(self) -> LoadProcess:
        from serving_load import Answer

        self._process = subprocess.Popen(
            [sys.executable, __file__, "--open-loop-worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._process.stdin.write(json.dumps(self.spec) + "\n")
        self._process.stdin.flush()

        def read() -> None:
            for line in self._process.stdout:
                sent, status, version, seconds = line.split()
                self.answers.append(Answer(float(sent), int(status), "" if version == "-" else version, float(seconds)))

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._process.stdin.close()
        try:
            self._process.wait(60)
        finally:
            self._process.kill()
            self._reader.join(10)

    def failed(self) -> list:
        return [answer for answer in self.answers if answer.status != 200]


def endpoint_processes() -> dict[str, list]:
    """This bench's descendants that serve: HAProxy, the model servers (by version: ``v<N>``),
    MLflow's scoring server; neither the sandboxes' bwrap and setpriv nor the bench's clients."""
    import psutil

    found: dict[str, list] = {"haproxy": [], "mlflow": []}
    for process in psutil.Process().children(recursive=True):
        try:
            name, command = process.name(), process.cmdline()
        except psutil.Error:
            continue
        if name == "haproxy":
            found["haproxy"].append(process)
        elif name in ("bwrap", "setpriv"):
            continue  # their command lines name the model server they start
        elif "--model-dir" in command and "--version" in command:
            found.setdefault("v" + command[command.index("--version") + 1], []).append(process)
        elif any("mlflow.pyfunc.scoring_server" in part for part in command):
            found["mlflow"].append(process)
    return found


def _cpu_seconds(groups: dict[str, list]) -> dict[str, float]:
    import psutil

    seconds = {}
    for name, processes in groups.items():
        total = 0.0
        for process in processes:
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                total += times.user + times.system
        seconds[name] = total
    return seconds


def closed_loop(target: dict, bodies: list[str], seconds: float, processes: int = 2, threads: int = 4) -> dict:
    """Max throughput: ``processes`` client processes of ``threads`` threads each (the client has
    cores of its own to contend for, not one GIL); its req/s, p50/p99, and the cores each side kept
    busy (client, HAProxy, model servers, other servers) over the run."""
    groups = endpoint_processes()
    spec = {**target, "bodies": bodies, "seconds": seconds, "threads": threads, "start_at": time.time() + 1.5}
    command = [sys.executable, __file__, "--closed-loop-worker"]
    clients = [
        subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(processes)
    ]
    try:
        for client in clients:
            client.stdin.write(json.dumps(spec))
            client.stdin.close()
        time.sleep(max(0.0, spec["start_at"] - time.time()))
        before = _cpu_seconds(groups)
        machine: list[float] = []
        watcher = threading.Thread(target=lambda: machine.append(busy_cores(seconds)))
        watcher.start()
        results = [json.loads(client.stdout.read()) for client in clients]
        after = _cpu_seconds(groups)
        watcher.join()
    finally:
        for client in clients:
            client.kill()
            client.wait()
    latencies = [ms for result in results for ms in result["latencies_ms"]]
    cores = {
        ("model servers" if name.startswith("v") else name): round((after[name] - before[name]) / seconds, 2)
        for name in before
        if groups[name]
    }
    cores["client"] = round(sum(result["cpu_seconds"] for result in results) / seconds, 2)
    cores["other work"] = round(max(0.0, machine[0] - sum(cores.values())), 2)  # the machine is shared
    return {
        "requests_per_second": round(len(latencies) / seconds, 1),
        "failed": sum(result["failures"] for result in results),
        "p50_ms": _percentile(latencies, 50),
        "p99_ms": _percentile(latencies, 99),
        "busy_cores": cores,
        "concurrency": processes * threads,
        "seconds": seconds,
    }


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if len(values) else None


def latency_figures(answers: list) -> dict:
    """Requests, failures, p50/p99 (ms) of the open-loop answers given."""
    times = [answer.seconds * 1000 for answer in answers if answer.status == 200]
    return {
        "requests": len(answers),
        "failed": sum(answer.status != 200 for answer in answers),
        "p50_ms": _percentile(times, 50),
        "p99_ms": _percentile(times, 99),
    }


# ---- the endpoint's processes' memory ----


class MemorySampler:
    """The endpoint's processes' RSS every ``interval`` s, in a thread: (monotonic time, HAProxy's
    bytes, {version: its model servers' bytes})."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.samples: list[tuple[float, int, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        import psutil

        while not self._stop.wait(self.interval):
            rss = {}
            for name, processes in endpoint_processes().items():
                total = 0
                for process in processes:
                    with contextlib.suppress(psutil.Error):
                        total += process.memory_info().rss
                rss[name] = total
            versions = {name[1:]: size for name, size in rss.items() if name.startswith("v")}
            self.samples.append((time.monotonic(), rss.get("haproxy", 0), versions))

    def between(self, start: float, end: float) -> list[tuple[float, int, dict[str, int]]]:
        return [sample for sample in self.samples if start <= sample[0] <= end]


# ---- the endpoint ----


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


def wait_for_rollout(endpoint, count: int) -> tuple[float, dict]:
    """The ``count``-th rollout's start and record, once written."""
    deadline = time.monotonic() + ROLLOUT_DEADLINE_SECONDS
    while len(endpoint.rollouts) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"rollout {count} did not finish within {ROLLOUT_DEADLINE_SECONDS:.0f} s")
        time.sleep(0.1)
    return endpoint.rollouts[count - 1]


def step_seconds(record: dict) -> dict:
    """Each step's seconds, the canary's split into its traffic steps (``canary_10`` ...)."""
    seconds = {}
    for step in record["steps"]:
        if step["step"] == "canary":
            for judged in step["canary_steps"]:
                seconds[f"canary_{judged['share']}"] = judged["seconds"]
        else:
            seconds[step["step"]] = step["seconds"]
    return seconds


def all_traffic_at(began: float, record: dict) -> float:
    """When the new version took all traffic: promote's first act, after every step before it."""
    return began + sum(step["seconds"] for step in record["steps"] if step["step"] != "promote")


def swap_memory(memory: MemorySampler, moved: float, promoted: float, done: float, old: str, new: str) -> dict:
    """Around one swap: the endpoint's RSS before (HAProxy and the old version), the new version's
    once alone, the peak during the swap, and how long after all traffic moved only the new
    version's servers were left."""
    mib = 1 << 20
    before = [s for s in memory.between(moved - 2.0, moved) if old in s[2]]
    after = [s for s in memory.between(done, done + SETTLE_SECONDS) if set(s[2]) == {new}]
    during = memory.between(moved, done)
    if not (before and after and during):
        return {}
    old_total = before[-1][1] + before[-1][2][old]
    new_alone = after[0][2][new]
    peak = max(s[1] + sum(s[2].values()) for s in during)
    one_version = next((s[0] for s in memory.between(promoted, done + 10.0) if set(s[2]) == {new}), None)
    return {
        "old_mib": round(old_total / mib, 1),
        "new_mib": round(new_alone / mib, 1),
        "peak_mib": round(peak / mib, 1),
        "limit_mib": round((old_total + new_alone) * MEMORY_SLACK / mib, 1),
        "one_version_after_s": None if one_version is None else round(one_version - promoted, 2),
    }


def move_champion(endpoint, registry, folder: Path) -> tuple:
    """A new version from ``folder`` made champion, as a reviewer does; once the endpoint has
    recorded its rollout: the champion before, the new version, when the
    alias moved, when the rollout began, its record, when it was done (monotonic times)."""
    from serving_models import register

    client = registry["client"]
    before = str(client.get_registered_model(MODEL).aliases["champion"])
    version = register(client, MODEL, folder)
    count = len(endpoint.rollouts) + 1  # the endpoint's rollouts are one at a time, in order
    moved = time.monotonic()
    client.set_registered_model_alias(MODEL, "champion", version)
    began, record = wait_for_rollout(endpoint, count)
    return before, version, moved, began, record, time.monotonic()


def swap_once(endpoint, registry, load, memory, folder: Path) -> dict:
    """Register a version from ``folder``, move champion to it, wait for its rollout; its figures."""
    old, new, moved, began, record, done = move_champion(endpoint, registry, folder)
    time.sleep(SETTLE_SECONDS)  # the new version alone, its memory sampled
    promoted = all_traffic_at(began, record)
    answers = [answer for answer in load.answers if moved <= answer.sent < done]
    phases = {}
    at = began
    for step in record["steps"]:
        window = [answer for answer in answers if at <= answer.sent < at + step["seconds"]]
        phases[step["step"]] = latency_figures(window)
        at += step["seconds"]
    fresh = sorted((a for a in answers if a.version == new and a.status == 200), key=lambda a: a.sent)
    return {
        "old": old,
        "new": new,
        # a fresh model server's first answers to the load (its warm-up sent the input example's 5 rows, the
        # load sends 1) against its later ones in the same swap
        "new_first_answers": latency_figures(fresh[:FIRST_ANSWERS]),
        "new_later_answers": latency_figures(fresh[FIRST_ANSWERS:]),
        "outcome": record.get("outcome"),
        "reason": record.get("reason"),
        "detect_seconds": round(began - moved, 2),
        "steps_seconds": step_seconds(record),
        "to_all_traffic_seconds": round(promoted - moved, 2),
        "seconds_to_recorded": round(done - moved, 2),
        "latency": latency_figures(answers),
        "latency_by_step": phases,
        "memory": swap_memory(memory, moved, promoted, done, old, new),
    }


def bad_candidate(endpoint, registry, load, folder: Path) -> dict:
    """A faulty version made champion under the load: how soon after its canary's first answer, and
    after the fault showed (its first failed answer, or its first slow one), traffic went back;
    whether ``champion`` came back; the canary's and the stable version's latency meanwhile."""
    previous, candidate, moved, began, record, done = move_champion(endpoint, registry, folder)
    client = registry["client"]
    answers = [answer for answer in load.answers if moved <= answer.sent < done]
    canary = sorted((a for a in answers if a.version == candidate), key=lambda a: a.sent)
    back = next((step for step in record["steps"] if step["step"] == "roll_back"), None)
    traffic_back = began + record["seconds"] - back["seconds"] if back else None
    failed = [a for a in canary if a.status != 200]
    shown = (failed or canary)[0] if canary else None  # a slow answer shows its fault as it arrives
    stable = [a for a in answers if a.version == previous and canary and a.sent >= canary[0].sent]
    return {
        "candidate": candidate,
        "outcome": record.get("outcome"),
        "reason": record.get("reason"),
        "champion_after": str(client.get_registered_model(MODEL).aliases["champion"]),
        "previous": previous,
        "canary_answers": len(canary),
        "canary_failed": len(failed),
        "failed_of_other_versions": sum(a.status != 200 for a in answers if a.version != candidate),
        "first_traffic_to_rollback_s": round(traffic_back - canary[0].sent, 2) if canary and back else None,
        "fault_shown_to_rollback_s": round(traffic_back - shown.sent - shown.seconds, 2) if shown and back else None,
        "canary_latency": latency_figures(canary),
        "stable_latency": latency_figures(stable),
        "steps_seconds": step_seconds(record),
        "roll_back_seconds": back["seconds"] if back else None,
    }


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


def summarize(record: dict) -> dict:
    """The figures DEPLOY.md states, from the record's measurements."""
    capacity, swaps = record["capacity"], record["swaps"]
    rps = {case: figures["requests_per_second"] for case, figures in capacity.items()}
    to_all = [swap["to_all_traffic_seconds"] for swap in swaps if swap["outcome"] == "promoted"]
    memory = [swap["memory"] for swap in swaps if swap["memory"]]
    promoted = [swap for swap in swaps if swap["outcome"] == "promoted"]
    steps = sorted({step for swap in promoted for step in swap["steps_seconds"]}, key=STEP_ORDER.index)
    return {
        "swaps": len(swaps),
        "promoted": len(to_all),
        "failed_during_swaps": record["during_swaps"]["failed"],
        "requests_during_swaps": record["during_swaps"]["requests"],
        "p99_ratio": _ratio(record["during_swaps"]["p99_ms"], record["steady"]["p99_ms"]),
        "to_all_traffic_p50_s": _percentile(to_all, 50),
        "to_all_traffic_p95_s": _percentile(to_all, 95),
        "step_median_s": {
            "detect": _percentile([swap["detect_seconds"] for swap in promoted], 50),
            **{step: _percentile([swap["steps_seconds"][step] for swap in promoted], 50) for step in steps},
        },
        "step_p99_median_ms": {
            step: _percentile(
                [
                    swap["latency_by_step"][step]["p99_ms"]
                    for swap in swaps
                    if swap["latency_by_step"].get(step, {}).get("p99_ms")
                ],
                50,
            )
            for step in ("stage", "start", "warm_and_check", "canary", "promote")
        },
        "first_answers_p99_median_ms": _percentile(_figure(swaps, "new_first_answers", "p99_ms"), 50),
        "later_answers_p99_median_ms": _percentile(_figure(swaps, "new_later_answers", "p99_ms"), 50),
        "memory_within_limit": sum(entry["peak_mib"] <= entry["limit_mib"] for entry in memory),
        "memory_swaps": len(memory),
        "memory_peak_over_old_plus_new_max": max(
            (_ratio(entry["peak_mib"], entry["limit_mib"] / MEMORY_SLACK) for entry in memory), default=None
        ),
        "one_version_after_max_s": max((entry["one_version_after_s"] or 1e9 for entry in memory), default=None),
        "endpoint_over_direct": _ratio(rps["endpoint"], rps["direct"]),
        "two_replicas_over_one": _ratio(rps["endpoint_2_replicas"], rps["endpoint"]),
        "endpoint_over_mlflow": _ratio(rps["endpoint_invocations"], rps["mlflow_invocations"]),
    }


STEP_ORDER = ["stage", "start", "warm_and_check", "canary_10", "canary_50", "canary", "promote", "roll_back"]


def _figure(swaps: list[dict], figures: str, key: str) -> list[float]:
    return [swap[figures][key] for swap in swaps if swap.get(figures, {}).get(key) is not None]


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 2) if numerator is not None and denominator else None


def _verdict(value: float | None, aim: float, at_least: bool = False) -> str:
    if value is None:
        return "not measured"
    return "met" if (value >= aim if at_least else value <= aim) else "not met"


def _cores(figures: dict) -> str:
    cores = figures["busy_cores"]
    shown = ", ".join(f"{side} {value:.2f}" for side, value in cores.items())
    return f"{shown} (sum {sum(cores.values()):.2f} cores)"


def markdown(record: dict) -> str:
    summary, capacity = record["summary"], record["capacity"]
    limits = record["limits"]
    lines = [
        "# Deployment: the endpoint of `hetflow serve` (#56)",
        "",
        f"Written by `{record['command']}` from `{record['results_file']}`, {record['date']}, "
        f"{record['wall_seconds']:.0f} s; {record['machine']}; git {record['git_at_start']}.",
        f"**Shared machine**: other helpers' work ran beside the bench. At its start the load average was "
        f"{', '.join(map(str, record['at_start']['load_average']))} and {record['at_start']['busy_cores']:.2f} "
        "cores were busy before it started anything: every figure below is from a machine the bench did not "
        "have to itself.",
        "",
        "Loopback only: clients → HAProxy on 127.0.0.1 → sandboxed model servers on Unix sockets, the real store "
        "(SQLite), one request = one instance of 8×8×1 uint8, a new connection per request.",
        "",
        *_capacity_lines(record, capacity),
        "",
        *_swap_lines(record, summary, limits),
        "",
        *_bad_candidate_lines(record),
        "",
        *_memory_lines(record, summary),
        "",
    ]
    return "\n".join(lines)


def _capacity_lines(record: dict, capacity: dict) -> list[str]:
    summary = record["summary"]
    rows = [
        ("endpoint, 1 replica (`:predict`)", "endpoint"),
        ("model server called directly (its Unix socket)", "direct"),
        ("endpoint, 2 replicas", "endpoint_2_replicas"),
        ("endpoint, 1 replica (`/invocations`)", "endpoint_invocations"),
        ("`mlflow models serve` alone (`/invocations`)", "mlflow_invocations"),
    ]
    lines = [
        "## Capacity (closed loop)",
        "",
        f"{capacity['endpoint']['concurrency']} requests in flight (2 client processes × 4 threads), "
        f"{capacity['endpoint']['seconds']:.0f} s each.",
        "",
        "| case | req/s | p50 ms | p99 ms | failed | cores busy |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for label, key in rows:
        figures = capacity[key]
        lines.append(
            f"| {label} | {figures['requests_per_second']:.1f} | {figures['p50_ms']} | {figures['p99_ms']} | "
            f"{figures['failed']} | {_cores(figures)} |"
        )
    lines += [
        "",
        f"- endpoint vs one model server called directly: **{summary['endpoint_over_direct']}×** "
        f"(aim ≥ 0.9×: {_verdict(summary['endpoint_over_direct'], 0.9, True)})",
        f"- 2 replicas vs 1 on 2 cores: **{summary['two_replicas_over_one']}×** "
        f"(aim ≥ 1.6×: {_verdict(summary['two_replicas_over_one'], 1.6, True)})",
        f"- endpoint vs `mlflow models serve` alone, same version, same `/invocations` requests: "
        f"**{summary['endpoint_over_mlflow']}×**",
        "- what bounds them: the cores column, each side's CPU seconds per second of the run (client: the load "
        "processes; mlflow: its scoring server; other work: the machine's busy cores, /proc/stat, less the "
        "bench's). Where the sum nears the machine's 2 cores, the cores bound the case; one replica is one Python "
        "process (its HTTP handling under one GIL), so its model servers' figure shows how near one core it ran.",
    ]
    return lines


def _swap_lines(record: dict, summary: dict, limits: dict) -> list[str]:
    steady, during = record["steady"], record["during_swaps"]
    shortened = limits["step_seconds"] != record["default_step_seconds"]
    step_note = (
        f"each canary step lasting at least **{limits['step_seconds']:g} s, shortened from the default "
        f"{record['default_step_seconds']:g} s** to fit the bench's time"
        if shortened
        else f"each canary step at least the default {limits['step_seconds']:g} s"
    )
    medians = summary["step_median_s"]
    fewer = (
        f" (**{summary['swaps']} of the {record['swaps_asked']} asked**)"
        if summary["swaps"] < record["swaps_asked"]
        else ""
    )
    return [
        "## Champion swaps under a steady load",
        "",
        f"Open loop at {record['rate_per_second']:.1f} req/s (half the endpoint's closed-loop capacity), "
        f"canary steps {'→'.join(map(str, limits['steps']))}%, {step_note}, at least {limits['min_requests']} "
        "canary answers per step.",
        "",
        f"- swaps in a row: **{summary['swaps']}**{fewer}, {summary['promoted']} promoted",
        *(
            f"  - v{swap['new']}, a healthy version, was {swap['outcome']}: {swap['reason']}; its first "
            f"{FIRST_ANSWERS} answers' p99 {swap.get('new_first_answers', {}).get('p99_ms')} ms"
            for swap in record["swaps"]
            if swap["outcome"] != "promoted"
        ),
        f"- failed requests during the swaps: **{summary['failed_during_swaps']} of "
        f"{summary['requests_during_swaps']}** (aim 0: {_verdict(summary['failed_during_swaps'], 0)})",
        f"- p99 during swaps {during['p99_ms']} ms vs steady {steady['p99_ms']} ms (p50 {during['p50_ms']} vs "
        f"{steady['p50_ms']} ms): **{summary['p99_ratio']}×** (aim ≤ 1.5×: {_verdict(summary['p99_ratio'], 1.5)}); "
        f"steady: the {steady['requests']} answers outside the swaps (the load's first seconds, p99 "
        f"{record.get('first_seconds', {}).get('p99_ms')} ms, and the pauses between swaps)",
        "- p99 by rollout step (median over the swaps, ms): "
        + ", ".join(f"{step} {value}" for step, value in summary["step_p99_median_ms"].items()),
        f"- alias moved → all traffic on the new version: p50 **{summary['to_all_traffic_p50_s']} s**, p95 "
        f"**{summary['to_all_traffic_p95_s']} s** (aim ≤ 30 s: {_verdict(summary['to_all_traffic_p95_s'], 30)})",
        f"- the new version's first {FIRST_ANSWERS} answers to the load: p99 {summary['first_answers_p99_median_ms']} "
        f"ms, its later answers in the swap {summary['later_answers_p99_median_ms']} ms (medians over the swaps)",
        "- where the time goes (median seconds over the promoted swaps; detect: the follower's poll of the alias, "
        "every 2 s): " + ", ".join(f"{step} {value}" for step, value in medians.items()),
    ]


def _bad_candidate_lines(record: dict) -> list[str]:
    slow_loop = record["slow_loop"]
    lines = [
        "## Bad candidates",
        "",
        f"Under the same load. *errors*: a model failing (500) on the 5% of inputs whose pixel sum is a multiple "
        f"of 20; *slow*: a loop of {slow_loop['iterations']} dense layers before answering, sized to add "
        f"{SLOW_FACTOR - 1:g}× the steady p50 ({slow_loop['base_p50_ms']} ms; {slow_loop['iteration_ms']} ms an "
        "iteration, timed here).",
        "",
        "| candidate | outcome | canary answers (failed) | canary p50 / stable p50 ms | first traffic → "
        "rollback s | fault shown → rollback s | champion after | reason |",
        "|---|---|---:|---|---:|---:|---|---|",
    ]
    for kind, figures in record["bad_candidates"].items():
        restored = "restored" if figures["champion_after"] == figures["previous"] else "**not restored**"
        lines.append(
            f"| {kind} (v{figures['candidate']}) | {figures['outcome']} | {figures['canary_answers']} "
            f"({figures['canary_failed']}) | {figures['canary_latency']['p50_ms']} / "
            f"{figures['stable_latency']['p50_ms']} | {figures['first_traffic_to_rollback_s']} | "
            f"**{figures['fault_shown_to_rollback_s']}** (aim ≤ 10: "
            f"{_verdict(figures['fault_shown_to_rollback_s'], 10)}) | v{figures['champion_after']} {restored} | "
            f"{figures['reason']} |"
        )
    return lines


def _memory_lines(record: dict, summary: dict) -> list[str]:
    peaks = [swap["memory"] for swap in record["swaps"] if swap["memory"]]
    shown = "; ".join(f"{entry['peak_mib']:.0f} of {entry['limit_mib']:.0f}" for entry in peaks[:5])
    return [
        "## Memory during a swap",
        "",
        "RSS of the endpoint's processes (HAProxy and the model servers), sampled every 0.2 s. old: HAProxy and the "
        "old version before the alias moved; new: the new version's servers once alone.",
        "",
        f"- peak within old + new + 15%: **{summary['memory_within_limit']} of {summary['memory_swaps']} swaps** "
        f"(peak / (old + new) at most {summary['memory_peak_over_old_plus_new_max']}×); the first swaps' peak "
        f"and limit, MiB: {shown}",
        f"- back to one version's servers after all traffic moved: at most **{summary['one_version_after_max_s']} s**"
        f" (aim ≤ 10 s: {_verdict(summary['one_version_after_max_s'], 10)})",
    ]


if __name__ == "__main__":
    main()

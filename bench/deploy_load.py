"""The deploy bench's load and measuring tools: closed- and open-loop client processes, the
endpoint's processes, their CPU seconds and memory, latency figures (bench/deploy.py runs them)."""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from report import busy_cores  # bench/report.py: the scripts run as bench/<name>.py

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))  # the endpoint's tests' models and load, shared with them
MODEL = "digits"


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
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "busy_cores": cores,
        "concurrency": processes * threads,
        "seconds": seconds,
    }


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if len(values) else None


def latency_figures(answers: list) -> dict:
    """Requests, failures, p50/p99 (ms) of the open-loop answers given."""
    times = [answer.seconds * 1000 for answer in answers if answer.status == 200]
    return {
        "requests": len(answers),
        "failed": sum(answer.status != 200 for answer in answers),
        "p50_ms": percentile(times, 50),
        "p99_ms": percentile(times, 99),
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

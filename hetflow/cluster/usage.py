"""Each replica's CPU and resident memory, sampled while it trains: what the live MLflow run charts
beside the curves (``hetflow.registry.live``). Read from outside the replicas (the kernel for local
processes, the engine for containers), never from anything a replica writes. A backend's replicas
offer theirs as ``usage_sampler()``; those of a swarm's other nodes or a Kubernetes cluster are not
seen from here (their own monitoring sees them)."""

from __future__ import annotations

import time

import psutil

# {replica name: {"cpu_percent": ..., "memory_mb": ...}}; 100 % is one core busy. Both to a tenth, as
# MLflow's own system metrics are: a sample is a moment's reading, not a measurement to 16 digits.
Usage = dict[str, dict[str, float]]


def _megabytes(resident_bytes: float) -> float:
    return round(resident_bytes / 2**20, 1)


class LocalUsage:
    """Local replicas, by their processes (found by run id: ``hetflow.cluster.processes``). A
    process's CPU is measured between two samples, so the first sample of each has its memory only."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._processes: dict[str, psutil.Process] = {}

    def __call__(self) -> Usage:
        from hetflow.cluster.processes import run_replicas

        usage = {}
        for name, pid in run_replicas(self.run_id).items():
            process = self._processes.get(name)
            try:
                if process is None or process.pid != pid:  # new, or restarted
                    process = self._processes[name] = psutil.Process(pid)
                    with process.oneshot():
                        process.cpu_percent(None)  # starts its measuring interval
                        usage[name] = {"memory_mb": _megabytes(process.memory_info().rss)}
                    continue
                with process.oneshot():
                    cpu_percent, resident = process.cpu_percent(None), process.memory_info().rss
            except psutil.Error:  # ended between the listing and the reading
                continue
            usage[name] = {"cpu_percent": round(cpu_percent, 1), "memory_mb": _megabytes(resident)}
        return usage


class ContainerUsage:
    """Docker containers, from the engine's stats (cgroup counters): CPU between two samples, so
    the first sample of each has its memory only."""

    def __init__(self, client, filters: dict, name_labels: tuple[str, str]):
        """:param filters: the run's containers, as ``containers.list`` takes them.
        :param name_labels: the labels whose values make a replica's name (role, index)."""
        self.client, self.filters, self.name_labels = client, filters, name_labels
        self._cpu: dict[str, tuple[float, float]] = {}  # name: (CPU ns used, when sampled)

    def __call__(self) -> Usage:
        from docker.errors import DockerException

        usage = {}
        role, index = self.name_labels
        for container in self.client.containers.list(filters=self.filters):
            name = f"{container.labels[role]}-{container.labels[index]}"
            try:
                stats = container.stats(stream=False, one_shot=True)
                used_ns = float(stats["cpu_stats"]["cpu_usage"]["total_usage"])
                memory = float(stats["memory_stats"]["usage"])
            except (KeyError, TypeError, DockerException):  # stopped meanwhile: no counters, or no container
                continue
            now = time.monotonic()
            before = self._cpu.get(name)
            self._cpu[name] = (used_ns, now)
            usage[name] = {"memory_mb": _megabytes(memory)}  # CPU, from the second sample on
            if before is not None and now > before[1] and used_ns >= before[0]:
                usage[name]["cpu_percent"] = round(100 * (used_ns - before[0]) / 1e9 / (now - before[1]), 1)
        return usage

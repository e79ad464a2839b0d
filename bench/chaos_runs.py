"""How ``make chaos`` (bench/chaos.py) drives its runs, for the scenarios of bench/chaos_scenarios.py.

Runs are driven the way Airflow drives them, without Airflow: a supervising process calls the
stages (``SUPERVISOR``), and the bench kills replicas, or signals that process, from outside.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hetflow.cluster.processes import run_processes
from hetflow.paths import run_dir_name

REPO_ROOT = Path(__file__).resolve().parents[1]

# Validates, prepares, provisions and trains one run, as the DAG's tasks do, here in one process;
# ``teardown`` as the script's third argument tears down after train (the kill scenarios), else
# nothing does (teardown is a task of its own in Airflow, which runs after train is gone). With a
# fourth and fifth argument it waits, after the slow imports, for the start file (argv[4]) to
# appear, having created argv[5]: runs started together prepare at the same moment.
SUPERVISOR = """
import json, sys, time
from pathlib import Path
from hetflow.pipeline.attempts import STAGES
from hetflow.tasks.prepare_data import prepare_data
from hetflow.tasks.provision_cluster import provision_cluster
from hetflow.tasks.summarize import summarize
from hetflow.tasks.teardown_cluster import teardown_cluster
from hetflow.tasks.train import train
from hetflow.tasks.validate_spec import validate_spec
import tensorflow_datasets  # noqa: F401
run_id, values, teardown, start = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "teardown", sys.argv[4:]
if start:
    Path(start[1]).touch()
    while not Path(start[0]).exists():
        time.sleep(0.01)
validate_spec(values, run_id)
prepare_data(run_id)
provision_cluster(run_id)
try:
    train(run_id)
finally:
    if teardown:
        teardown_cluster(run_id)
"""


@dataclass
class Bench:
    root: Path  # a temporary directory: every HETFLOW_HOME of the bench is under it
    token: str  # in every run id, so that nothing else on this host shares one
    rng: random.Random
    runs: int  # runs of kill_random
    docker: object | None  # a Docker client, None when no engine answers
    docker_missing: str | None  # why there is none
    image: str  # the replica image of the docker scenario
    homes: set[Path] = field(default_factory=set)

    def home(self, name: str = "home") -> Path:
        home = (self.root / name).resolve()  # as the runs' hetflow_home() has it: the sweep compares run dirs with it
        home.mkdir(exist_ok=True)
        self.homes.add(home)
        return home

    def run_id(self, name: str) -> str:
        return f"chaos-{self.token}-{name}"


def run_dir(home: Path, run_id: str) -> Path:
    return home / "runs" / run_dir_name(run_id)


def environment(home: Path) -> dict[str, str]:
    return {**os.environ, "HETFLOW_HOME": str(home), "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db"}


def start(
    bench: Bench, home: Path, run_id: str, values: dict, teardown: bool = True, together: tuple = ()
) -> subprocess.Popen:
    """The supervising process of a run (``SUPERVISOR``); its stderr goes to a file beside the
    homes, as a pipe nobody reads during the run could fill and block it."""
    command = [sys.executable, "-c", SUPERVISOR, run_id, json.dumps(values), "teardown" if teardown else "-"]
    errors = open(bench.root / f"{run_id}.stderr", "wb")
    with errors:
        return subprocess.Popen(
            [*command, *map(str, together)],
            cwd=REPO_ROOT,
            env=environment(home),
            stdout=subprocess.DEVNULL,
            stderr=errors,
        )


def finish(bench: Bench, process: subprocess.Popen, run_id: str) -> tuple[int, str | None]:
    """Wait for the process; its exit code and, when it failed, the end of its stderr."""
    code = process.wait()
    tail = (bench.root / f"{run_id}.stderr").read_text(errors="replace")[-1500:]
    return code, tail if code else None


def wait_for_epoch(process: subprocess.Popen, log: Path, epoch: int, timeout: float = 600) -> bool:
    """Until the replica's log shows ``Epoch <epoch>/``; False if the run ended first."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        if log.exists() and f"Epoch {epoch}/" in log.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


def epochs_completed(log: Path) -> list[int]:
    """The number of every epoch the replica finished, over all its starts (a restarted replica's
    output is appended to its log): Keras ends an epoch with ``39/39 - 1s - ... - val_accuracy: ...``
    after its ``Epoch N/E`` line, the custom loops with ``Epoch N/E - ... - val_accuracy: ...``."""
    done, current = [], None
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        header = re.match(r"Epoch (\d+)/\d+", line)
        if header:
            current = int(header.group(1))
        if " - val_accuracy: " in line and current is not None:
            done.append(current)
    return done


def leftovers(bench: Bench, home: Path, run_id: str) -> dict:
    """What of the run is still there: processes with its id in their environment (keepers, sandboxes
    and replicas), its containers and network."""
    found = {
        "processes": sorted(run_processes(run_id, home)),
        "containers": [],
        "networks": [],
    }
    if bench.docker is not None:
        from hetflow.cluster.engine import run_filter

        found["containers"] = sorted(c.name for c in bench.docker.containers.list(all=True, filters=run_filter(run_id)))
        found["networks"] = sorted(n.name for n in bench.docker.networks.list(filters=run_filter(run_id)))
    return found


def replica_count(found: dict) -> int:
    """Replica processes (keepers too) and containers in ``leftovers``' answer."""
    return len(found["processes"]) + len(found["containers"])


def docker_unavailable(bench: Bench) -> str | None:
    if bench.docker is None:
        return bench.docker_missing
    import docker

    try:
        bench.docker.images.get(bench.image)
    except docker.errors.ImageNotFound:
        return f"the image {bench.image} is not on the Docker engine (make image)"
    return None


def teardown(home: Path, run_id: str) -> None:
    """The DAG's teardown_cluster task, for a run that ended before its fault was injected."""
    command = [
        sys.executable,
        "-c",
        "import sys; from hetflow.tasks.teardown_cluster import teardown_cluster; teardown_cluster(sys.argv[1])",
        run_id,
    ]
    subprocess.run(command, cwd=REPO_ROOT, env=environment(home), capture_output=True)

"""The stack's six processes: Airflow's api-server, scheduler, dag-processor and triggerer
(LocalExecutor), ``mlflow server`` and ``hetflow serve`` (the endpoint serving each champion) —
starting them, telling whether one still runs, stopping them.

Each is started in a session of its own, so that stopping it can signal its whole process group
(uvicorn workers, executor workers, task supervisors and the replicas they started) and then kill
whatever of its descendants is left. A component is known by its pid with its create time, checked
before signalling (a pid the system gave to another process is left alone); its descendants by the
stack's id in their environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from devstack.mlflow_auth import server_environment
from devstack.secrets import open_private, private_dir, stack_dir
from hetflow.cli.serve import TF_SERVING_REST_PORT
from hetflow.cluster.processes import environments_with, start_ticks
from hetflow.paths import REPO_ROOT
from hetflow.registry.store import tracking_uri

STACK_ID_ENV = "HETFLOW_STACK_ID"  # in every component's environment, so in their descendants'
STOP_GRACE = 20  # seconds between SIGTERM and SIGKILL


def _log(component: str):
    """The component's log file, appended to, readable by its owner only."""
    logs = private_dir(stack_dir() / "logs")
    return os.fdopen(open_private(logs / f"{component}.log", os.O_APPEND), "ab")


def sqlite_store() -> Path:
    uri = tracking_uri()
    if not uri.startswith("sqlite:///"):
        raise SystemExit(f"make up serves a SQLite MLflow store; MLFLOW_TRACKING_URI={uri} is not one")
    return Path(uri.removeprefix("sqlite:///"))


def _commands(airflow_port: int, mlflow_port: int, serve_port: int = TF_SERVING_REST_PORT) -> dict[str, list[str]]:
    airflow = [sys.executable, "-m", "airflow"]
    store = sqlite_store()
    return {
        "api-server": [*airflow, "api-server", "--host", "127.0.0.1", "--port", str(airflow_port)],
        # Their log servers listen on every interface ([::]:8793, :8794, host not configurable); the
        # api-server reads the task logs from this machine's files instead.
        "scheduler": [*airflow, "scheduler", "--skip-serve-logs"],
        "dag-processor": [*airflow, "dag-processor"],
        "triggerer": [*airflow, "triggerer", "--skip-serve-logs"],
        "mlflow": mlflow_server_command(store, mlflow_port, login=True),
        # On 127.0.0.1, reading the store directly as the tasks do; SIGTERM ends its HAProxy and model servers.
        "endpoint": [sys.executable, "-m", "hetflow.cli.main", "serve", "--port", str(serve_port)],
    }  # fmt: skip


def mlflow_server_command(store: Path, port: int, login: bool = False) -> list[str]:
    """``mlflow server`` over the SQLite store ``store`` on 127.0.0.1:``port``; with ``login``, behind
    MLflow's basic-auth app (its settings in the environment: ``devstack.mlflow_auth``)."""
    return [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{store}",
        # Where the registry puts the hetflow experiment's artifacts for a SQLite store.
        "--default-artifact-root", (store.parent / "artifacts").as_uri(),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        *(["--app-name", "basic-auth"] if login else []),
    ]  # fmt: skip


def create_time(pid: int) -> str | None:
    """When the process was created: this boot's id and the clock ticks from boot to its start
    (field 22 of /proc/PID/stat). With the pid it names one process; unlike psutil's create_time()
    it does not move when the wall clock is set. None if there is no such process."""
    ticks = start_ticks(pid)
    if ticks is None:
        return None
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}+{ticks}"


def component_environment(name: str, env: dict[str, str]) -> dict[str, str]:
    """The environment of component ``name``: the stack's ``env``, plus the login's secrets for the
    MLflow server only (Airflow's tasks write to the store directly)."""
    return {**env, **server_environment("up")} if name == "mlflow" else env


def start(env: dict[str, str], airflow_port: int, mlflow_port: int, serve_port: int) -> dict[str, dict]:
    """Start every component in a session of its own, its output appended to ``stack/logs/``.
    Returns each one's pid and create time, by name."""
    started = {}
    for name, command in _commands(airflow_port, mlflow_port, serve_port).items():
        with _log(name) as log:
            process = subprocess.Popen(
                command,
                env=component_environment(name, env),
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started[name] = {"pid": process.pid, "create_time": create_time(process.pid)}
    return started


def running(started: dict) -> psutil.Process | None:
    """The process ``start`` started (``started``: its pid and create time), if it still runs;
    None if it has ended or its pid now belongs to another process."""
    try:
        process = psutil.Process(started["pid"])
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.NoSuchProcess:
        return None
    return process if create_time(process.pid) == started["create_time"] else None


def _carrying_stack_id(stack_id: str) -> list[psutil.Process]:
    """Live processes with this stack's id in their environment: the components and every
    descendant, also one whose component has died (which leaves no group to signal)."""
    found = []
    for pid in environments_with(f"{STACK_ID_ENV}={stack_id}"):
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return found


def stop(started: dict[str, dict], stack_id: str) -> list[str]:
    """Stop the components ``start`` started by process group, and each descendant outside those
    groups; kill whatever outlived SIGTERM. Returns the names of those that still ran: the others
    had ended, or their pid is now another process's, which is left alone."""
    components = {name: running(process) for name, process in started.items()}
    groups = {process.pid for process in components.values() if process}  # each leads its session's group
    processes = set(_carrying_stack_id(stack_id))
    for process in components.values():
        try:
            processes.update(process.children(recursive=True) if process else [])  # one that reset its environment
        except psutil.NoSuchProcess:
            pass
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for process in processes:
        try:
            if os.getpgid(process.pid) not in groups:
                process.terminate()  # psutil refuses if the pid was reused meanwhile
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    _, alive = psutil.wait_procs(processes, timeout=STOP_GRACE)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return [name for name, process in components.items() if process]

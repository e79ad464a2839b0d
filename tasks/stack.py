"""``make up`` / ``make down``: Airflow 3 and the MLflow server on 127.0.0.1, over hetflow's own stores.

The stack is five processes — Airflow's api-server, scheduler, dag-processor and triggerer
(LocalExecutor) and ``mlflow server`` — each started in a session of its own, so that ``down`` can
signal each one's whole process group (uvicorn workers, executor workers, task supervisors and
the replicas they started) and then kill whatever of their descendants is left. They use the same
Airflow home (``$HETFLOW_HOME/airflow``) and MLflow store as ``hetflow run``: runs made either way
show in the same UIs. Tasks write to the MLflow store directly (``MLFLOW_TRACKING_URI``, a SQLite
file), not through the server, so training never depends on the server being up; the server only
serves the UI over that same file.

State (pids, what was started, logs, generated secrets) lives in ``$HETFLOW_HOME/stack/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from tasks.cli import airflow_environment
from tasks.paths import REPO_ROOT, hetflow_home
from tasks.registry import tracking_uri

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer", "mlflow")
HEALTHY_TIMEOUT = 180  # seconds; a cold start here takes ~40 s
STOP_GRACE = 20  # seconds between SIGTERM and SIGKILL


def stack_dir() -> Path:
    return hetflow_home() / "stack"


def _state_path() -> Path:
    return stack_dir() / "state.json"


def _secrets() -> dict[str, str]:
    """Secrets every Airflow component must share (JWTs signed by one are checked by another),
    generated once per HETFLOW_HOME and kept out of the repo."""
    path = stack_dir() / "secrets.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        values = {name: secrets.token_urlsafe(32) for name in ("jwt_secret", "api_secret_key", "postgres_password")}
        path.touch(mode=0o600)
        path.write_text(json.dumps(values))
    return json.loads(path.read_text())


def _sqlite_store() -> Path:
    uri = tracking_uri()
    if not uri.startswith("sqlite:///"):
        raise SystemExit(f"make up serves a SQLite MLflow store; MLFLOW_TRACKING_URI={uri} is not one")
    return Path(uri.removeprefix("sqlite:///"))


def _postgres_admin(*command: str) -> subprocess.CompletedProcess:
    """Run a command as Debian's ``postgres`` superuser (peer authentication on the local socket)."""
    become = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else ["sudo", "-n", "-u", "postgres"]
    return subprocess.run([*become, *command], check=True, capture_output=True, text=True)


def _start_postgres(password: str) -> tuple[str, str | None]:
    """Start Debian's PostgreSQL cluster if it is down; make a role and a database for this
    HETFLOW_HOME. Returns the SQLAlchemy URL and the cluster we started (None if it was running)."""
    clusters = subprocess.run(["pg_lsclusters", "--no-header"], check=True, capture_output=True, text=True)
    version, name, port, status = clusters.stdout.split()[:4]
    started = None
    if status != "online":
        subprocess.run(["pg_ctlcluster", version, name, "start"], check=True)
        started = f"{version}/{name}"
    database = "hetflow_" + hashlib.sha256(str(hetflow_home()).encode()).hexdigest()[:10]
    if not _postgres_admin("psql", "-tAc", "SELECT 1 FROM pg_roles WHERE rolname = 'hetflow'").stdout.strip():
        _postgres_admin("psql", "-c", "CREATE ROLE hetflow LOGIN")
    _postgres_admin("psql", "-c", f"ALTER ROLE hetflow PASSWORD '{password}'")
    if not _postgres_admin("psql", "-tAc", f"SELECT 1 FROM pg_database WHERE datname = '{database}'").stdout.strip():
        _postgres_admin("createdb", "--owner=hetflow", database)
    return f"postgresql+psycopg2://hetflow:{password}@127.0.0.1:{port}/{database}", started


def environment(airflow_port: int, login: bool, database_url: str | None) -> dict[str, str]:
    """The environment of every component: hetflow's stores plus the settings of a small local stack."""
    keys = _secrets()
    env = {
        **os.environ,
        **airflow_environment(),
        "HETFLOW_HOME": str(hetflow_home()),
        "MLFLOW_TRACKING_URI": tracking_uri(),
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        # Task processes reach the api-server's execution API here, not at the default localhost:8080.
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{airflow_port}/execution/",
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{airflow_port}",
        "AIRFLOW__API__WORKERS": "1",  # the default 4 uvicorn workers cost ~1 GB for one user
        "AIRFLOW__API_AUTH__JWT_SECRET": keys["jwt_secret"],
        "AIRFLOW__API__SECRET_KEY": keys["api_secret_key"],
        # New and edited DAG files show up within ~10 s instead of 5 minutes.
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "10",
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "10",
        # The plugin that checks hetflow_train's conf with hetflow's own rules at trigger time.
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO_ROOT / "plugins"),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False" if login else "True",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # jobs pre-fork workers worth ~2.5 GB
    }
    if database_url:
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = database_url
    return env


def _commands(airflow_port: int, mlflow_port: int) -> dict[str, list[str]]:
    airflow = [sys.executable, "-m", "airflow"]
    store = _sqlite_store()
    return {
        "api-server": [*airflow, "api-server", "--host", "127.0.0.1", "--port", str(airflow_port)],
        "scheduler": [*airflow, "scheduler"],
        "dag-processor": [*airflow, "dag-processor"],
        "triggerer": [*airflow, "triggerer"],
        "mlflow": [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{store}",
            # Where registry.py puts the hetflow experiment's artifacts for a SQLite store.
            "--default-artifact-root", (store.parent / "artifacts").as_uri(),
            "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1",
        ],
    }  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _read_state() -> dict | None:
    return json.loads(_state_path().read_text()) if _state_path().exists() else None


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read()
    except OSError:
        return None


def health(state: dict) -> dict[str, str]:
    """Each component's health as Airflow's /api/v2/monitor/health and MLflow's /health report it."""
    report = {name: "down" for name in ("metadatabase", "scheduler", "triggerer", "dag_processor", "mlflow")}
    body = _get(f"{state['airflow_url']}/api/v2/monitor/health")
    if body:
        for name, value in json.loads(body).items():
            report[name] = (value or {}).get("status") or "unknown"
    report["mlflow"] = "healthy" if _get(f"{state['mlflow_url']}/health") == b"OK" else "down"
    return report


def wait_healthy(state: dict, timeout: float = HEALTHY_TIMEOUT) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        report = health(state)
        if all(status == "healthy" for status in report.values()):
            return report
        dead = [name for name, pid in state["pids"].items() if not _alive(pid)]
        if dead or time.monotonic() > deadline:
            logs = stack_dir() / "logs"
            raise SystemExit(f"stack not healthy: {report}; exited: {dead or 'none'}; logs in {logs}")
        time.sleep(1)


def _ensure_database(env: dict[str, str], fresh: bool) -> None:
    """``airflow db migrate`` when the metadata DB may be new (it is idempotent, but takes ~15 s)."""
    if fresh or not (Path(env["AIRFLOW_HOME"]) / "airflow.db").exists():
        print("migrating the Airflow metadata DB ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL
        )


def _free(port: int) -> bool:
    return not any(c.laddr.port == port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN)


def up(airflow_port: int, mlflow_port: int, login: bool, postgres: bool) -> tuple[dict, bool]:
    """Start the stack, or find it already running; wait until every component is healthy.
    Returns the stack's state and whether this call started it."""
    state = _read_state()
    if state and all(_alive(pid) for pid in state["pids"].values()):
        wait_healthy(state)
        return state, False
    if state:  # a component died: start over cleanly
        down()
    for port in (airflow_port, mlflow_port):
        if not _free(port):
            raise SystemExit(f"port {port} on 127.0.0.1 is in use by another program")
    started_at = time.monotonic()
    database_url, started_postgres = _start_postgres(_secrets()["postgres_password"]) if postgres else (None, None)
    env = environment(airflow_port, login, database_url)
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    _ensure_database(env, fresh=postgres)
    logs = stack_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    pids = {}
    for name, command in _commands(airflow_port, mlflow_port).items():
        with (logs / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                command, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        pids[name] = process.pid
    state = {
        "pids": pids,
        "airflow_url": f"http://127.0.0.1:{airflow_port}",
        "mlflow_url": f"http://127.0.0.1:{mlflow_port}",
        "airflow_home": env["AIRFLOW_HOME"],
        "login": login,
        "database": "postgresql" if postgres else "sqlite",
        "started_postgres": started_postgres,
    }
    _state_path().write_text(json.dumps(state, indent=2))
    wait_healthy(state)
    state["seconds_to_healthy"] = round(time.monotonic() - started_at, 1)
    _state_path().write_text(json.dumps(state, indent=2))
    return state, True


def password(state: dict) -> str | None:
    """The admin password the simple auth manager generated (None while it has not yet)."""
    path = Path(state["airflow_home"]) / "simple_auth_manager_passwords.json.generated"
    return json.loads(path.read_text()).get("admin") if path.exists() else None


def rss_bytes(state: dict) -> int:
    """Resident memory of the whole stack: every component and its descendants."""
    total = 0
    for pid in state["pids"].values():
        try:
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def down() -> list[str]:
    """Stop every component by process group, then kill any descendant that outlived its group's
    SIGTERM (a task's replicas run in sessions of their own); stop PostgreSQL if ``up`` started it."""
    state = _read_state()
    if not state:
        return []
    processes = []
    for pid in state["pids"].values():
        try:
            root = psutil.Process(pid)
            processes += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for pid in state["pids"].values():
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    _, alive = psutil.wait_procs(processes, timeout=STOP_GRACE)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    if state.get("started_postgres"):
        subprocess.run(["pg_ctlcluster", *state["started_postgres"].split("/"), "stop"], check=True)
    _state_path().unlink()
    return list(state["pids"])


def _print_up(state: dict, started: bool) -> None:
    rss = rss_bytes(state) / 2**30
    took = f" in {state['seconds_to_healthy']} s" if started else " (already running)"
    print(f"hetflow stack healthy{took}; {rss:.1f} GiB resident; logs in {stack_dir() / 'logs'}")
    print(f"  Airflow  {state['airflow_url']}   metadata DB: {state['database']}")
    if state["login"]:
        secret = Path(state["airflow_home"]) / "simple_auth_manager_passwords.json.generated"
        print(f"           log in as admin, password {password(state)} (kept in {secret})")
    else:
        print("           login off (LOGIN=off): everyone is admin — local development only")
    print(f"  MLflow   {state['mlflow_url']}   store: {tracking_uri()}")
    print("  stop with: make down")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.stack", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("up", help="start the stack (or find it running) and wait until it is healthy")
    start.add_argument("--airflow-port", type=int, default=8080)
    start.add_argument("--mlflow-port", type=int, default=5000)
    start.add_argument("--no-login", action="store_true", help="everyone is admin: local development only")
    start.add_argument("--postgres", action="store_true", help="Debian's PostgreSQL as Airflow's metadata DB")
    commands.add_parser("down", help="stop every process of the stack")
    args = parser.parse_args(argv)
    if args.command == "up":
        _print_up(*up(args.airflow_port, args.mlflow_port, not args.no_login, args.postgres))
    else:
        stopped = down()
        print(f"stopped: {', '.join(stopped)}" if stopped else "hetflow stack: nothing running")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``make up`` / ``make down``: Airflow 3 and the MLflow server on 127.0.0.1, over hetflow's own stores.

The stack is five processes — Airflow's api-server, scheduler, dag-processor and triggerer
(LocalExecutor) and ``mlflow server`` — each started in a session of its own, so that ``down`` can
signal each one's whole process group (uvicorn workers, executor workers, task supervisors and
the replicas they started) and then kill whatever of their descendants is left. They use the same
Airflow home (``$HETFLOW_HOME/airflow``) and MLflow store as ``hetflow run``: runs made either way
show in the same UIs. Tasks write to the MLflow store directly (``MLFLOW_TRACKING_URI``, a SQLite
file), not through the server, so training never depends on the server being up; the server only
serves the UI over that same file.

State (pids, what was started, logs, generated secrets) lives in ``$HETFLOW_HOME/stack/``, readable
by its owner only: the admin password is generated here, handed to Airflow in a file, and never
printed or logged. ``down`` signals only processes ``up`` started: each component's pid with its
create time, checked before signalling (a pid the system gave to another process is left alone),
and whatever carries the stack's id in its environment (their descendants).
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
from typing import Callable

import psutil

from tasks.cli import airflow_environment
from tasks.cluster.local import environments_with, teardown_runs_of_home
from tasks.paths import REPO_ROOT, hetflow_home
from tasks.registry import tracking_uri

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer", "mlflow")
STACK_ID_ENV = "HETFLOW_STACK_ID"  # in every component's environment, so in their descendants'
HEALTHY_TIMEOUT = 180  # seconds; a cold start here takes ~40 s
STOP_GRACE = 20  # seconds between SIGTERM and SIGKILL


def stack_dir() -> Path:
    return hetflow_home() / "stack"


def _state_path() -> Path:
    return stack_dir() / "state.json"


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _open_private(path: Path, flags: int) -> int:
    """Open (creating) a file only its owner can read; one left more open by an older hetflow is
    closed down too."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600)
    os.fchmod(descriptor, 0o600)
    return descriptor


def write_private(path: Path, text: str) -> None:
    with os.fdopen(_open_private(path, os.O_TRUNC), "w") as file:
        file.write(text)


def generated_once(name: str, values: Callable[[], dict[str, str]]) -> dict[str, str]:
    """Secrets in ``stack/<name>``, generated on first use and kept out of the repo."""
    path = _private_dir(stack_dir()) / name
    if not path.exists():
        write_private(path, json.dumps(values()))
    path.chmod(0o600)
    return json.loads(path.read_text())


def stack_secrets() -> dict[str, str]:
    """Secrets every Airflow component must share (JWTs signed by one are checked by another)."""
    names = ("jwt_secret", "api_secret_key", "postgres_password")
    return generated_once("secrets.json", lambda: {name: secrets.token_urlsafe(32) for name in names})


def password_file() -> Path:
    """The file of the admin's password, in the simple auth manager's format. Airflow generates
    one when the file lacks it and prints it to the api-server's log: hetflow generates it first."""
    generated_once("passwords.json", lambda: {"admin": secrets.token_urlsafe(16)})
    return stack_dir() / "passwords.json"


def _log(component: str):
    """The component's log file, appended to, readable by its owner only."""
    logs = _private_dir(stack_dir() / "logs")
    return os.fdopen(_open_private(logs / f"{component}.log", os.O_APPEND), "ab")


def _sqlite_store() -> Path:
    uri = tracking_uri()
    if not uri.startswith("sqlite:///"):
        raise SystemExit(f"make up serves a SQLite MLflow store; MLFLOW_TRACKING_URI={uri} is not one")
    return Path(uri.removeprefix("sqlite:///"))


def _postgres_admin(*command: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run a command as Debian's ``postgres`` superuser (peer authentication on the local socket)."""
    become = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else ["sudo", "-n", "-u", "postgres"]
    return subprocess.run([*become, *command], input=stdin, check=True, capture_output=True, text=True)


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
    # On stdin: a command line is visible to every user in `ps`.
    _postgres_admin("psql", "-v", "ON_ERROR_STOP=1", stdin=f"ALTER ROLE hetflow PASSWORD '{password}'")
    if not _postgres_admin("psql", "-tAc", f"SELECT 1 FROM pg_database WHERE datname = '{database}'").stdout.strip():
        _postgres_admin("createdb", "--owner=hetflow", database)
    return f"postgresql+psycopg2://hetflow:{password}@127.0.0.1:{port}/{database}", started


def environment(airflow_port: int, login: bool, database_url: str | None) -> dict[str, str]:
    """The environment of every component: hetflow's stores plus the settings of a small local stack."""
    keys = stack_secrets()
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
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(password_file()),
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


def _create_time(pid: int) -> str | None:
    """When the process was created: this boot's id and the clock ticks from boot to its start
    (field 22 of /proc/PID/stat). With the pid it names one process; unlike psutil's create_time()
    it does not move when the wall clock is set. None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    # Field 2, the command name, may hold spaces and parentheses: count the fields after its ')'.
    return f"{boot}+{stat[stat.rindex(')') + 2 :].split()[19]}"


def _component(started: dict) -> psutil.Process | None:
    """The process ``up`` started (``started``: its pid and create time), if it still runs; None
    if it has ended or its pid now belongs to another process."""
    try:
        process = psutil.Process(started["pid"])
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.NoSuchProcess:
        return None
    return process if _create_time(process.pid) == started["create_time"] else None


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


def _read_state() -> dict | None:
    if not _state_path().exists():
        return None
    state = json.loads(_state_path().read_text())
    if "processes" not in state:  # pids without create times cannot be told from reused ones
        raise SystemExit(
            f"{_state_path()} was written by an older hetflow: stop its processes ({state['pids']}) yourself, "
            "then remove the file"
        )
    return state


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
        dead = [name for name, started in state["processes"].items() if not _component(started)]
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
    if state and all(_component(started) for started in state["processes"].values()):
        wait_healthy(state)
        return state, False
    if state:  # a component died: start over cleanly
        down()
    for port in (airflow_port, mlflow_port):
        if not _free(port):
            raise SystemExit(f"port {port} on 127.0.0.1 is in use by another program")
    started_at = time.monotonic()
    database_url, started_postgres = _start_postgres(stack_secrets()["postgres_password"]) if postgres else (None, None)
    stack_id = secrets.token_hex(8)
    env = {**environment(airflow_port, login, database_url), STACK_ID_ENV: stack_id}
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    # A password Airflow generated before hetflow made its own: world-readable, and no longer used.
    Path(env["AIRFLOW_HOME"], "simple_auth_manager_passwords.json.generated").unlink(missing_ok=True)
    _ensure_database(env, fresh=postgres)
    processes = {}
    for name, command in _commands(airflow_port, mlflow_port).items():
        with _log(name) as log:
            process = subprocess.Popen(
                command, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        processes[name] = {"pid": process.pid, "create_time": _create_time(process.pid)}
    state = {
        "processes": processes,
        "stack_id": stack_id,
        "airflow_url": f"http://127.0.0.1:{airflow_port}",
        "mlflow_url": f"http://127.0.0.1:{mlflow_port}",
        "airflow_home": env["AIRFLOW_HOME"],
        "login": login,
        "database": "postgresql" if postgres else "sqlite",
        "started_postgres": started_postgres,
        "password_file": str(password_file()),
    }
    write_private(_state_path(), json.dumps(state, indent=2))
    wait_healthy(state)
    state["seconds_to_healthy"] = round(time.monotonic() - started_at, 1)
    write_private(_state_path(), json.dumps(state, indent=2))
    return state, True


def password(state: dict) -> str:
    """The admin's password."""
    return json.loads(Path(state["password_file"]).read_text())["admin"]


def rss_bytes(state: dict) -> int:
    """Resident memory of the whole stack: every component and its descendants."""
    total = 0
    for started in state["processes"].values():
        try:
            root = _component(started)
            for process in [root, *root.children(recursive=True)] if root else []:
                total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def down() -> dict[str, list[str]]:
    """Stop every component ``up`` started by process group, and each descendant outside those
    groups; kill whatever outlived SIGTERM; then end every replica of a run under this
    HETFLOW_HOME (they run in sessions of their own); stop PostgreSQL if ``up`` started it.
    Returns the components ``stopped``, and those ``gone``: ended, or their pid now another
    process's, which is left alone."""
    state = _read_state()
    if not state:
        return {"stopped": [], "gone": []}
    components = {name: _component(started) for name, started in state["processes"].items()}
    groups = {process.pid for process in components.values() if process}  # each leads its session's group
    processes = set(_carrying_stack_id(state["stack_id"]))
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
    # Runs the scheduler was running: replicas provisioned and not yet supervised outlive it.
    teardown_runs_of_home(hetflow_home())
    if state.get("started_postgres"):
        subprocess.run(["pg_ctlcluster", *state["started_postgres"].split("/"), "stop"], check=True)
    _state_path().unlink()
    stopped = [name for name, process in components.items() if process]
    return {"stopped": stopped, "gone": [name for name in components if name not in stopped]}


def _print_up(state: dict, started: bool) -> None:
    rss = rss_bytes(state) / 2**30
    took = f" in {state['seconds_to_healthy']} s" if started else " (already running)"
    print(f"hetflow stack healthy{took}; {rss:.1f} GiB resident; logs in {stack_dir() / 'logs'}")
    print(f"  Airflow  {state['airflow_url']}   metadata DB: {state['database']}")
    if state["login"]:  # the password itself is never printed: terminals and CI jobs keep their output
        print(f"           log in as admin, password in {state['password_file']} (yours only)")
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
        ended = down()
        if ended["stopped"]:
            print(f"stopped: {', '.join(ended['stopped'])}")
        if ended["gone"]:
            print(f"already ended (left alone, their pids may be other processes' now): {', '.join(ended['gone'])}")
        if not ended["stopped"] and not ended["gone"]:
            print("hetflow stack: nothing running")
    return 0


if __name__ == "__main__":
    sys.exit(main())

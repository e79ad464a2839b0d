"""``make up`` / ``make down``: Airflow 3, the MLflow server and ``hetflow serve``'s endpoint on
127.0.0.1, over hetflow's own stores.

The stack is six processes (``devstack.processes``) that use the same Airflow home
(``$HETFLOW_HOME/airflow``) and MLflow store as ``hetflow run``: runs made either way show in the
same UIs. Tasks write to the MLflow store directly (``MLFLOW_TRACKING_URI``, a SQLite file), not
through the server, so training never depends on the server being up; the server only serves the
UI and the REST API over that same file, to its admin only (``devstack.mlflow_auth``), and the
store's folder is its owner's only: the registry is not every local user's. The endpoint reads that
file too, and serves each registered model's champion on TF Serving's REST port, following the alias.

State (pids, what was started, logs, generated secrets) lives in ``$HETFLOW_HOME/stack/``, readable
by its owner only (``devstack.secrets``). ``down`` signals only processes ``up`` started.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from devstack.mlflow_auth import credentials_file
from devstack.postgres import start_postgres, stop_postgres
from devstack.processes import STACK_ID_ENV, running, sqlite_store, start, stop
from devstack.secrets import password_file, private_dir, stack_dir, stack_secrets, write_private
from hetflow.cli.dag_run import airflow_environment
from hetflow.cli.serve import TF_SERVING_REST_PORT
from hetflow.cluster.processes import teardown_runs_of_home
from hetflow.paths import REPO_ROOT, hetflow_home
from hetflow.registry.store import MLFLOW_UI_ENV, client, runs_page, tracking_uri

HEALTHY_TIMEOUT = 180  # seconds: a cold start on two busy cores takes a fraction of it


def _state_path() -> Path:
    return stack_dir() / "state.json"


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
        # The trigger form shows why a trigger was refused right above its Trigger button.
        "AIRFLOW__API__THEME": (REPO_ROOT / "plugins" / "ui_theme.json").read_text(),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(password_file()),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False" if login else "True",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # jobs pre-fork workers worth ~2.5 GB
    }
    if database_url:
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = database_url
    return env


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
    """Each component's health as Airflow's /api/v2/monitor/health and MLflow's /health report it;
    the endpoint's as its HAProxy answers (its own statistics): it may serve no champion yet."""
    names = ("metadatabase", "scheduler", "triggerer", "dag_processor", "mlflow", "endpoint")
    report = {name: "down" for name in names if name != "endpoint" or "endpoint_url" in state}
    body = _get(f"{state['airflow_url']}/api/v2/monitor/health")
    if body:
        for name, value in json.loads(body).items():
            report[name] = (value or {}).get("status") or "unknown"
    report["mlflow"] = "healthy" if _get(f"{state['mlflow_url']}/health") == b"OK" else "down"
    if "endpoint" in report:  # a stack started by an earlier hetflow has none
        report["endpoint"] = "healthy" if _get(f"{state['endpoint_url']}/metrics/haproxy") is not None else "down"
    return report


def wait_healthy(state: dict, timeout: float = HEALTHY_TIMEOUT) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        report = health(state)
        if all(status == "healthy" for status in report.values()):
            return report
        dead = [name for name, started in state["processes"].items() if not running(started)]
        if dead or time.monotonic() > deadline:
            logs = stack_dir() / "logs"
            raise SystemExit(f"stack not healthy: {report}; exited: {dead or 'none'}; logs in {logs}")
        time.sleep(1)


def _ensure_database(env: dict[str, str], fresh: bool) -> None:
    """``airflow db migrate`` when the metadata DB may be new (it is idempotent, but slow)."""
    if fresh or not (Path(env["AIRFLOW_HOME"]) / "airflow.db").exists():
        print("migrating the Airflow metadata DB ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL
        )


def _free(port: int) -> bool:
    return not any(c.laddr.port == port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN)


def up(
    airflow_port: int, mlflow_port: int, login: bool, postgres: bool, serve_port: int = TF_SERVING_REST_PORT
) -> tuple[dict, bool]:
    """Start the stack, or find it already running; wait until every component is healthy.
    Returns the stack's state and whether this call started it."""
    state = _read_state()
    if state and all(running(started) for started in state["processes"].values()):
        wait_healthy(state)
        return state, False
    if state:  # a component died: start over cleanly
        down()
    for port in (airflow_port, mlflow_port, serve_port):
        if not _free(port):
            raise SystemExit(f"port {port} on 127.0.0.1 is in use by another program")
    started_at = time.monotonic()
    database_url, started_postgres = start_postgres(stack_secrets()["postgres_password"]) if postgres else (None, None)
    stack_id = secrets.token_hex(8)
    env = {**environment(airflow_port, login, database_url), STACK_ID_ENV: stack_id}
    env[MLFLOW_UI_ENV] = f"http://127.0.0.1:{mlflow_port}"  # the tasks write to the store itself
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    # A password Airflow generated before hetflow made its own: world-readable, and no longer used.
    Path(env["AIRFLOW_HOME"], "simple_auth_manager_passwords.json.generated").unlink(missing_ok=True)
    _ensure_database(env, fresh=postgres)
    private_dir(sqlite_store().parent)  # the store and its artifacts: read around the server's login otherwise
    # The store's tables made once, here: the MLflow server and the endpoint both open it as they start,
    # and two first migrations of one SQLite file race (alembic: "expected to match one row ... 0 found").
    client(f"sqlite:///{sqlite_store()}").search_experiments(max_results=1)
    state = {
        "processes": start(env, airflow_port, mlflow_port, serve_port),
        "stack_id": stack_id,
        "airflow_url": f"http://127.0.0.1:{airflow_port}",
        "mlflow_url": f"http://127.0.0.1:{mlflow_port}",
        "endpoint_url": f"http://127.0.0.1:{serve_port}",
        "airflow_home": env["AIRFLOW_HOME"],
        "login": login,
        "database": "postgresql" if postgres else "sqlite",
        "started_postgres": started_postgres,
        "password_file": str(password_file()),
        "mlflow_credentials": str(credentials_file()),
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
            root = running(started)
            for process in [root, *root.children(recursive=True)] if root else []:
                total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def down() -> dict[str, list[str]]:
    """Stop every process ``up`` started, then end every replica of a run under this HETFLOW_HOME
    (they run in sessions of their own); stop PostgreSQL if ``up`` started it. Returns the
    components ``stopped``, and those ``gone``: ended, or their pid now another process's, which
    is left alone."""
    state = _read_state()
    if not state:
        return {"stopped": [], "gone": []}
    stopped = stop(state["processes"], state["stack_id"])
    # Runs the scheduler was running: replicas provisioned and not yet supervised outlive it.
    teardown_runs_of_home(hetflow_home())
    if state.get("started_postgres"):
        stop_postgres(state["started_postgres"])
    _state_path().unlink()
    return {"stopped": stopped, "gone": [name for name in state["processes"] if name not in stopped]}


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
    print(f"           log in as admin, password (admin_password) in {credentials_file()} (yours only)")
    print(f"           hetflow's runs: {runs_page(state['mlflow_url'])}")
    print(f"           their key metrics: {runs_page(state['mlflow_url'], key_metrics=True)}")
    if "endpoint_url" in state:
        print(f"  Endpoint {state['endpoint_url']}/v1/models/<name>:predict   TF Serving's REST API (hetflow serve)")
        print("           serves each registered model's champion and follows the alias; make run registers one")
    print("  stop with: make down")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack.stack", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up_parser = commands.add_parser("up", help="start the stack (or find it running) and wait until it is healthy")
    up_parser.add_argument("--airflow-port", type=int, default=8080)
    up_parser.add_argument("--mlflow-port", type=int, default=5000)
    up_parser.add_argument(
        "--serve-port", type=int, default=TF_SERVING_REST_PORT, help="the endpoint's (hetflow serve)"
    )
    up_parser.add_argument("--no-login", action="store_true", help="everyone is admin: local development only")
    up_parser.add_argument("--postgres", action="store_true", help="Debian's PostgreSQL as Airflow's metadata DB")
    commands.add_parser("down", help="stop every process of the stack")
    args = parser.parse_args(argv)
    if args.command == "up":
        _print_up(*up(args.airflow_port, args.mlflow_port, not args.no_login, args.postgres, args.serve_port))
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

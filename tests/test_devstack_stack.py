"""``make up`` / ``make down`` safety (devstack/stack.py): secrets and logs readable by their owner
only, the admin password in no output, and ``down`` signalling only processes ``up`` started.

The whole stack starts in tests/ui_stack.py (for the UI tests); here its parts are checked directly,
with real processes, real files and Airflow's own auth manager.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, wait_for

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture
def home(hetflow_env, tmp_path, monkeypatch):
    """A HETFLOW_HOME of the test's own, so that its stack state and secrets are fresh."""
    monkeypatch.setenv("HETFLOW_HOME", str(tmp_path))
    return tmp_path


def _ended(pid: int) -> bool:
    """Gone, or a zombie (exit status not yet read): down() itself reaps the ones that are its children."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secrets_password_and_logs_are_their_owners_only(home):
    from devstack import processes, stack

    (home / "stack" / "logs").mkdir(parents=True)
    old_log = home / "stack" / "logs" / "api-server.log"
    old_log.write_bytes(b"before\n")
    old_log.chmod(0o644)  # as an older hetflow left it
    env = stack.environment(8080, login=True, database_url=None)
    with processes._log("api-server") as log:
        log.write(b"after\n")
    assert old_log.read_bytes() == b"before\nafter\n"
    secret_files = [home / "stack" / "secrets.json", home / "stack" / "passwords.json"]
    assert [_mode(path) for path in [home / "stack", *secret_files, old_log]] == [0o700, 0o600, 0o600, 0o600]
    assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"] == str(secret_files[1])
    assert len(json.loads(secret_files[1].read_text())["admin"]) >= 16


def test_airflow_takes_the_generated_password_without_printing_it(home):
    """Airflow's simple auth manager, started as the api-server starts it, uses hetflow's password
    file as it is: no password of its own, nothing printed, the file's mode kept."""
    from devstack import secrets, stack

    env = stack.environment(8080, login=True, database_url=None)
    path = secrets.password_file()
    before = path.read_text()
    started = subprocess.run(
        [
            sys.executable,
            "-c",
            "from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager as M\n"
            "M().init()\nprint('passwords', M.get_passwords())",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    admin = json.loads(before)["admin"]
    printed = started.stdout.replace(f"passwords {{'admin': '{admin}'}}\n", "") + started.stderr
    assert f"passwords {{'admin': '{admin}'}}" in started.stdout  # Airflow reads the password from our file
    assert admin not in printed and "Password for user" not in printed
    assert path.read_text() == before and _mode(path) == 0o600
    assert not (home / "airflow" / "simple_auth_manager_passwords.json.generated").exists()


def test_make_up_says_where_the_password_is_not_what_it_is(home, capsys):
    from devstack import secrets, stack

    state = {
        "processes": {},
        "airflow_url": "http://127.0.0.1:8080",
        "mlflow_url": "http://127.0.0.1:5000",
        "database": "sqlite",
        "login": True,
        "password_file": str(secrets.password_file()),
        "seconds_to_healthy": 1.0,
    }
    stack._print_up(state, started=True)
    printed = capsys.readouterr().out
    assert f"log in as admin, password in {secrets.password_file()}" in printed
    assert stack.password(state) not in printed


def test_create_time_reads_the_kernels_start_time_whatever_the_process_is_called(hetflow_env):
    """The command name in /proc/PID/stat may hold spaces and parentheses."""
    from devstack.processes import create_time

    named = subprocess.Popen(
        [sys.executable, "-c", "open('/proc/self/comm', 'w').write('a) b (c'); print(flush=True); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        named.stdout.readline()
        assert psutil.Process(named.pid).name() == "a) b (c"
        boot, ticks = create_time(named.pid).split("+")
        started = int(ticks) / os.sysconf("SC_CLK_TCK") + psutil.boot_time()
        assert abs(started - psutil.Process(named.pid).create_time()) < 0.02
        assert boot == open("/proc/sys/kernel/random/boot_id").read().strip()
    finally:
        named.kill()
        named.wait()
    assert create_time(named.pid) is None


def test_down_stops_what_up_started_and_leaves_a_reused_pid_alone(home):
    """State names three components: one still running (stopped, its whole group); one whose pid
    now belongs to another process (left alone); one that died leaving a child that carries the
    stack's id (stopped). A process of another stack is left alone too."""
    from devstack import processes, secrets, stack

    stack_id = "stack-under-test"
    ours_env = {**os.environ, processes.STACK_ID_ENV: stack_id}
    component = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         f"subprocess.Popen({SLEEPER!r}); print(flush=True); time.sleep(600)"],
        env=ours_env, stdout=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    ended = subprocess.Popen(SLEEPER, start_new_session=True)
    ended_started = processes.create_time(ended.pid)
    time.sleep(0.1)  # the kernel hands a pid out again only after going round the others: not in the same tick
    ended.kill()
    ended.wait()
    reused = subprocess.Popen(SLEEPER, start_new_session=True)  # stands for a process given the ended one's pid
    orphan = subprocess.Popen(SLEEPER, env=ours_env, start_new_session=True)
    other_stack = subprocess.Popen(
        SLEEPER, env={**os.environ, processes.STACK_ID_ENV: "another"}, start_new_session=True
    )
    try:
        component.stdout.readline()
        (grandchild,) = psutil.Process(component.pid).children()
        state = {
            "stack_id": stack_id,
            "processes": {
                "scheduler": {"pid": component.pid, "create_time": processes.create_time(component.pid)},
                "triggerer": {"pid": reused.pid, "create_time": ended_started},
                "mlflow": {"pid": 2**22 + 1, "create_time": "a process long gone"},
            },
        }
        secrets.private_dir(secrets.stack_dir())
        secrets.write_private(stack._state_path(), json.dumps(state))

        assert stack.down() == {"stopped": ["scheduler"], "gone": ["triggerer", "mlflow"]}
        assert all(_ended(process.pid) for process in (component, orphan, grandchild))
        assert [reused.poll(), other_stack.poll()] == [None, None]
        assert not stack._state_path().exists()
    finally:
        for process in (component, reused, orphan, other_stack):
            process.kill()
            process.wait()


def _listening(pid: int) -> set[str]:
    """The addresses that a process and its children listen on."""
    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for process in tree:
        try:
            found |= {c.laddr.ip for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    return found


def _running_jobs(home) -> set[str]:
    import sqlite3

    from hetflow.cli.dag_run import airflow_environment

    with sqlite3.connect(Path(airflow_environment()["AIRFLOW_HOME"]) / "airflow.db") as db:
        return {row[0] for row in db.execute("SELECT job_type FROM job WHERE state = 'running'")}


@pytest.mark.slow
def test_the_scheduler_and_triggerer_of_make_up_listen_on_no_interface(home):
    """Their log servers listened on [::]:8793 and 8794, reachable from other hosts, serving task
    logs to whoever asked: the stack's processes listen on loopback or nowhere."""
    from devstack.processes import _commands
    from hetflow.cli.dag_run import airflow_environment, ensure_airflow_db

    env = {**os.environ, **airflow_environment()}
    os.environ.update(airflow_environment())
    ensure_airflow_db()
    commands = _commands(airflow_port=0, mlflow_port=0)
    started = {
        name: subprocess.Popen(commands[name], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for name in ("scheduler", "triggerer")
    }
    try:
        # Running once its job is in the DB: a log server (if any) started before the job did.
        assert wait_for(lambda: _running_jobs(home) >= {"SchedulerJob", "TriggererJob"}, timeout=240)
        time.sleep(10)  # for the log server to bind, where there is one
        assert all(process.poll() is None for process in started.values())
        for name, process in started.items():
            assert _listening(process.pid) <= {"127.0.0.1", "::1"}, f"{name} listens on {_listening(process.pid)}"
    finally:
        for process in started.values():
            process.terminate()
        for process in started.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def test_make_ups_mlflow_refuses_anyone_without_the_admins_login(home):
    """Any local user reaches 127.0.0.1: without a login they could read the registry and move
    ``champion`` with one REST call. The server make up starts answers 401 to an anonymous or wrong
    login, and serves the admin whose password make up generated (stack/mlflow.json, 0600)."""
    import requests

    from devstack import mlflow_auth, processes
    from hetflow.serving.server import free_port
    from mlflow import MlflowClient

    port = free_port()
    command = processes._commands(airflow_port=0, mlflow_port=port)["mlflow"]
    env = processes.component_environment("mlflow", {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    with (home / "server.log").open("w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _answers(f"{url}/health"), timeout=180), (home / "server.log").read_text()[-3000:]
        password = json.loads(mlflow_auth.credentials_file().read_text())["admin_password"]
        assert _mode(mlflow_auth.credentials_file()) == 0o600 and len(password) >= 16
        search = f"{url}/api/2.0/mlflow/experiments/search?max_results=5"
        create = f"{url}/api/2.0/mlflow/registered-models/create"
        assert requests.get(search, timeout=30).status_code == 401
        assert requests.post(create, json={"name": "planted"}, timeout=30).status_code == 401
        assert requests.get(search, auth=("admin", "not-the-password"), timeout=30).status_code == 401
        assert requests.get(search, auth=("admin", password), timeout=30).status_code == 200
        os.environ.update(mlflow_auth.client_environment())
        try:  # a client with the admin's login in its environment, as the compose stack's tasks have it
            assert MlflowClient(url).create_registered_model("behind-the-login").name == "behind-the-login"
        finally:
            for name in mlflow_auth.client_environment():
                os.environ.pop(name)
        assert password not in (home / "server.log").read_text()
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)


def _answers(url: str) -> bool:
    import requests

    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.RequestException:
        return False

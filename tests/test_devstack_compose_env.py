"""The compose stack's safety (docker/compose.yaml): login on by default, no default secret in
docker/compose.yaml (``make up-docker`` generates them, 0600 in a 0700 folder), and the Docker
socket only in the service that provisions replicas.

No image can be pulled here, so the stack is checked offline: the compose file as parsed, as the
compose CLI resolves it with and without the env file (where a CLI is installed), and Airflow's
own auth manager started with the api-server's resolved settings.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

COMPOSE_FILE = REPO / "docker" / "compose.yaml"
SOCKET = "/var/run/docker.sock:/var/run/docker.sock"
# ${NAME}, ${NAME:-default}, ${NAME:?message} and the like
REFERENCE = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|KEY|TOKEN")


def _services() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]  # PyYAML resolves the `<<:` merges


def _strings(value) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def _resolve(text: str, variables: dict[str, str]) -> str:
    """Compose's interpolation of the forms compose.yaml uses."""

    def value(match: re.Match) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        if variables.get(name):
            return variables[name]
        assert op != ":?", f"{name} is required: {arg}"
        return arg if op == ":-" else ""

    return REFERENCE.sub(value, text)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _env_values(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


@pytest.fixture
def socket(tmp_path) -> Path:
    """Stands for the engine's socket: its group is what the scheduler gets."""
    path = tmp_path / "docker.sock"
    path.touch()
    return path


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HETFLOW_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# --- the compose file ------------------------------------------------------------------------------


def test_only_the_scheduler_gets_the_docker_socket_and_its_group():
    """With the LocalExecutor, provision_cluster/train/teardown run in the scheduler: the socket
    (root on the host) goes there and nowhere else."""
    services = _services()
    with_socket = {name for name, s in services.items() if any(SOCKET in v for v in s.get("volumes", []))}
    with_group = {name for name, s in services.items() if s.get("group_add")}
    assert with_socket == with_group == {"airflow-scheduler"}
    assert "${HETFLOW_HOME}:${HETFLOW_HOME}" in services["airflow-scheduler"]["volumes"]  # the runs, still
    [group] = services["airflow-scheduler"]["group_add"]
    assert REFERENCE.fullmatch(group)["name"] == "DOCKER_GID" and REFERENCE.fullmatch(group)["op"] == ":?"


def test_no_service_runs_as_root_or_gains_capabilities():
    """Every service names a user (the env file's HETFLOW_UID, never 0: devstack/compose_env.py), none
    is privileged or adds a capability; only the scheduler, which already holds the Docker socket,
    leaves Docker's seccomp profile and /proc masks, so that bubblewrap can sandbox what it runs."""
    services = _services()
    for name, service in services.items():
        # Never group 0: the host's root group may read or write what the images' user may not.
        assert service.get("user") in ("postgres", "${HETFLOW_UID:-10001}:${HETFLOW_GID:-10001}"), name
        assert not service.get("privileged") and not service.get("cap_add"), name
    confined_less = {name: s["security_opt"] for name, s in services.items() if s.get("security_opt")}
    # and the endpoint, whose model servers bubblewrap sandboxes as the served check's (and which
    # holds no socket and mounts only its own folder of HETFLOW_HOME)
    unconfined = ["seccomp=unconfined", "systempaths=unconfined"]
    assert confined_less == {"airflow-scheduler": unconfined, "endpoint": unconfined}
    assert services["endpoint"]["volumes"] == ["${HETFLOW_HOME}/serve:${HETFLOW_HOME}/serve"]


def test_no_secret_has_a_default_value():
    """Every secret is required (``${NAME:?...}``): a start without the env file stops, naming it,
    instead of running on a password everybody knows."""
    text = COMPOSE_FILE.read_text()
    references = list(REFERENCE.finditer(text))
    secrets = {m["name"] for m in references if SECRET_NAME.search(m["name"])}
    assert {
        "POSTGRES_PASSWORD",
        "AIRFLOW_JWT_SECRET",
        "AIRFLOW_API_SECRET_KEY",
        "AIRFLOW_FERNET_KEY",
        "SERVE_TOKEN",
    } <= secrets
    for match in references:
        if match["name"] in secrets:
            assert match["op"] == ":?" and "make up-docker" in match["arg"], match[0]
    # Nothing secret written out literally: database URLs carry the password by reference only.
    for value in _strings(_services()):
        for url in re.findall(r"postgresql\S*://[^@\s]*@", value):
            assert re.fullmatch(r"postgresql\+psycopg2://hetflow:\$\{POSTGRES_PASSWORD:\?[^}]*\}@", url), url
    # The password is not on a command line, which every user of the host sees in `ps`.
    assert not [arg for s in _services().values() for arg in _strings(s.get("command", [])) if "PASSWORD" in arg]


def test_login_is_on_in_every_airflow_component():
    services = _services()
    airflow = [name for name in services if name.startswith("airflow-")]
    assert len(airflow) == 5
    for name in airflow:
        env = services[name]["environment"]
        assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"] == "admin:admin"
        # Off unless the env file says otherwise (LOGIN=off): the default is login on.
        assert _resolve(env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS"], {}) == "False"
        assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"].startswith("${AIRFLOW_PASSWORDS_FILE:?")


# --- the env file make up-docker writes ------------------------------------------------------------


def test_env_file_holds_every_required_variable_owner_only_generated_once_per_home(tmp_path, monkeypatch, socket):
    from devstack import compose_env

    def write(home: Path, **kwargs) -> dict[str, str]:
        monkeypatch.setenv("HETFLOW_HOME", str(home))
        path = compose_env.write_env_file(socket, **kwargs)
        assert path == home / "stack" / "compose.env"
        assert _mode(home / "stack") == 0o700
        assert {p.name: _mode(p) for p in (home / "stack").iterdir()} == {
            name: 0o600
            for name in (
                "compose.env",
                "secrets.json",
                "passwords.json",
                "fernet.json",
                "mlflow.json",
                "mlflow-auth-compose.ini",
                "serve.json",
            )
        }
        return _env_values(path)

    first, again = write(tmp_path / "a"), write(tmp_path / "a")
    other = write(tmp_path / "b")
    secrets = ["POSTGRES_PASSWORD", "AIRFLOW_JWT_SECRET", "AIRFLOW_API_SECRET_KEY", "AIRFLOW_FERNET_KEY", "SERVE_TOKEN"]
    assert first == again  # re-used on a later start: PostgreSQL keeps the password of its first start
    for name in secrets:
        assert len(first[name]) >= 32 and first[name] != other[name], name
    assert len({first[name] for name in secrets}) == len(secrets)
    from cryptography.fernet import Fernet

    Fernet(first["AIRFLOW_FERNET_KEY"])  # in the format Airflow needs
    required = {m["name"] for m in REFERENCE.finditer(COMPOSE_FILE.read_text()) if m["op"] == ":?"}
    assert required <= set(first)
    assert first["HETFLOW_HOME"] == str(tmp_path / "a")
    # Root's stack runs as the images' user, which must read the password file and write the runs.
    uid = os.getuid() or compose_env.IMAGE_UID
    assert first["HETFLOW_UID"] == str(uid) != "0" and first["HETFLOW_GID"] != "0"
    assert first["MLFLOW_AUTH_CONFIG"] == str(tmp_path / "a" / "stack" / "mlflow-auth-compose.ini")
    assert "default_permission = NO_PERMISSIONS" in Path(first["MLFLOW_AUTH_CONFIG"]).read_text()
    assert Path(first["MLFLOW_AUTH_CONFIG"]).stat().st_uid == uid  # the MLflow container reads it
    assert {
        (tmp_path / "a" / name).stat().st_uid for name in ("", "runs", "data", "serve", "stack/passwords.json")
    } == {uid}
    assert _mode(tmp_path / "a" / "serve") == 0o700  # the endpoint's control socket's folder, which its service mounts
    assert first["DOCKER_GID"] == str(socket.stat().st_gid)
    assert first["AIRFLOW_ALL_ADMINS"] == "False"
    passwords = Path(first["AIRFLOW_PASSWORDS_FILE"])
    assert passwords == tmp_path / "a" / "stack" / "passwords.json"
    admin = json.loads(passwords.read_text())["admin"]
    assert admin not in (tmp_path / "a" / "stack" / "compose.env").read_text()  # named, not copied
    assert write(tmp_path / "a", login=False)["AIRFLOW_ALL_ADMINS"] == "True"  # LOGIN=off


def test_make_up_docker_says_where_the_password_is_not_what_it_is(home, socket, monkeypatch, capsys):
    from devstack import compose_env

    monkeypatch.setattr(compose_env, "DOCKER_SOCKET", socket)
    compose_env.main([])
    printed = capsys.readouterr().out
    passwords = home / "stack" / "passwords.json"
    assert f"log in as admin, password in {passwords}" in printed
    values = _env_values(home / "stack" / "compose.env")
    for secret in [json.loads(passwords.read_text())["admin"], values["POSTGRES_PASSWORD"]]:
        assert secret not in printed
    compose_env.main(["--no-login"])
    assert "login off" in capsys.readouterr().out


def test_the_endpoint_is_published_on_loopback_behind_its_token_and_make_up_docker_names_where_it_is(
    home, socket, monkeypatch, capsys
):
    """hetflow serve listens on the container's every interface (a port on its loopback cannot be
    published), so it requires its token there; the host sees it on 127.0.0.1 only, at SERVE_PORT."""
    from devstack import compose_env

    endpoint = _services()["endpoint"]
    assert endpoint["ports"] == ["127.0.0.1:${SERVE_PORT:-8501}:8501"]
    assert endpoint["command"][-5:] == ["serve", "--host", "0.0.0.0", "--port", "8501"]
    assert endpoint["environment"]["HETFLOW_SERVE_TOKEN"].startswith("${SERVE_TOKEN:?")
    assert endpoint["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"  # the champion, through the server
    monkeypatch.setattr(compose_env, "DOCKER_SOCKET", socket)
    compose_env.main(["--serve-port", "9501"])
    printed = capsys.readouterr().out.splitlines()
    token_file = home / "stack" / "serve.json"
    at = printed.index(
        "  Endpoint http://127.0.0.1:9501/v1/models/<name>:predict: TF Serving's REST API (hetflow serve), "
        "each registered model's champion"
    )
    assert printed[at + 1].strip() == f"send Authorization: Bearer <token>, the token in {token_file} (yours only)"
    token = json.loads(token_file.read_text())["token"]
    assert _env_values(home / "stack" / "compose.env")["SERVE_TOKEN"] == token
    assert _env_values(home / "stack" / "compose.env")["SERVE_PORT"] == "9501"
    assert token not in "\n".join(printed)


def test_no_engine_socket_is_one_line(home, tmp_path):
    from devstack import compose_env

    with pytest.raises(SystemExit, match="no Docker engine socket at .*make engine"):
        compose_env.write_env_file(tmp_path / "absent.sock")


def test_airflow_takes_the_generated_password_with_the_api_servers_settings(home, socket):
    """Airflow's simple auth manager, with the api-server's environment as compose resolves it from
    the env file: login on, hetflow's password used as it is, nothing printed."""
    from devstack import compose_env

    variables = _env_values(compose_env.write_env_file(socket))
    settings = _services()["airflow-apiserver"]["environment"]
    env = {name: _resolve(str(value), variables) for name, value in settings.items()}
    env = {**os.environ, **env, "AIRFLOW_HOME": str(home / "airflow")}
    del env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]  # the auth manager needs no database
    passwords = Path(variables["AIRFLOW_PASSWORDS_FILE"])
    before = passwords.read_text()
    started = subprocess.run(
        [
            sys.executable,
            "-c",
            "from airflow.configuration import conf\n"
            "from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager as M\n"
            "M().init()\n"
            "print('all_admins', conf.getboolean('core', 'simple_auth_manager_all_admins'))\n"
            "print('users', [u.username for u in M.get_users()], M.get_passwords() == __import__('json').load("
            f"open({str(passwords)!r})))",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    assert "all_admins False" in started.stdout and "users ['admin'] True" in started.stdout
    admin = json.loads(before)["admin"]
    assert admin not in started.stdout + started.stderr and "Password for user" not in started.stdout + started.stderr
    assert passwords.read_text() == before and _mode(passwords) == 0o600


# --- the compose CLI, where one is installed (it resolves `config` without an engine) ---------------


def _compose_cli() -> list[str] | None:
    """``docker compose`` (v2), else Debian bookworm's ``docker-compose`` (v1)."""
    if shutil.which("docker"):
        if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.mark.skipif(not _compose_cli(), reason="no compose CLI: neither `docker compose` nor `docker-compose`")
def test_compose_config_fails_clearly_without_the_env_file_and_resolves_with_it(home, socket, tmp_path):
    from devstack import compose_env

    command, file = _compose_cli(), COMPOSE_FILE
    if command == ["docker-compose"]:  # v1 predates the top-level `name`
        spec = yaml.safe_load(COMPOSE_FILE.read_text())
        del spec["name"]
        file = tmp_path / "compose.yaml"
        file.write_text(yaml.safe_dump(spec))
    command = [*command, "--project-directory", str(REPO / "docker"), "-f", str(file)]
    env = {k: v for k, v in os.environ.items() if k != "HETFLOW_HOME"}  # only what the env file says

    missing = subprocess.run([*command, "config"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert missing.returncode != 0
    # Compose names the first missing variable it meets, in no fixed order: each says that make
    # up-docker provides it.
    assert re.search(r"required variable \w+ is missing a value: [^\n]*make up-docker", missing.stderr), missing.stderr

    path = compose_env.write_env_file(socket)
    resolved = subprocess.run(
        [*command, "--env-file", str(path), "config"], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert resolved.returncode == 0, resolved.stderr
    services = yaml.safe_load(resolved.stdout)["services"]
    values = _env_values(path)
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == values["POSTGRES_PASSWORD"]
    apiserver = services["airflow-apiserver"]["environment"]
    assert apiserver["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS"] == "False"
    assert apiserver["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"] == str(home / "stack" / "passwords.json")
    assert services["airflow-scheduler"]["group_add"] == [values["DOCKER_GID"]]

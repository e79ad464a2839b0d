"""``make up-docker``'s env file: the secrets and settings docker/compose.yaml is started with.

The compose stack takes the secrets ``make up`` generates for this HETFLOW_HOME (``devstack.secrets``:
once, into ``$HETFLOW_HOME/stack/``, folder 0700, files 0600), the MLflow server's login
(``devstack.mlflow_auth``), plus a Fernet key that its Airflow containers, each with an Airflow home
of its own, must share. The env file is rewritten on every
start from those files, so the values stay the same. The admin's password stays in
``stack/passwords.json``, which the api-server reads through the bind-mounted HETFLOW_HOME: the
env file names that file, and nothing prints the password. The images docker/stack-images.sh chose
(``build/stack-images.env``: PostgreSQL's official image or the one built offline) and the ports
go in too, so that every compose command of one stack resolves the same file. The endpoint's
bearer token (``stack/serve.json``: beyond its container's loopback ``hetflow serve`` requires one)
is generated once too, and named, never printed.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import sys
from pathlib import Path

# make up's own secrets, so both stacks make and keep their secrets one way.
from devstack import mlflow_auth
from devstack.secrets import generated_once, password_file, private_dir, stack_dir, stack_secrets, write_private
from hetflow.cli.serve import TF_SERVING_REST_PORT
from hetflow.paths import REPO_ROOT, hetflow_home
from hetflow.registry.store import runs_page

DOCKER_SOCKET = Path("/var/run/docker.sock")
IMAGES_FILE = REPO_ROOT / "build" / "stack-images.env"
# The unprivileged user of hetflow's images (docker/Dockerfile) and its group, which the stack runs
# as where `make up-docker` is run by root.
IMAGE_UID = IMAGE_GID = 10001
PROJECT = "hetflow"  # compose.yaml's name (COMPOSE_PROJECT_NAME overrides it): its volume is <project>_postgres-data


def env_file() -> Path:
    return stack_dir() / "compose.env"


def container_uid() -> int:
    """The uid the stack's containers run as: yours, so that what they write in HETFLOW_HOME is
    yours; never root, whose tasks could not sandbox what others wrote (bubblewrap as root needs
    capabilities a container does not get), so root's stack runs as the images' own user and is
    handed what it writes: HETFLOW_HOME's top, runs/, serve/ and stack/ (not their contents), the
    prepared data, MLflow's artifacts, the admin's password file and the MLflow login's settings.
    Root still reads and writes all of it."""
    home = hetflow_home()
    # The endpoint's folder (its control socket), the one part of HETFLOW_HOME its service mounts:
    # made here, or the engine would make the bind mount's source root's.
    private_dir(home / "serve")
    if os.getuid() != 0:
        return os.getuid()
    for folder in (home, home / "runs", home / "data", home / "mlflow-artifacts"):
        folder.mkdir(parents=True, exist_ok=True)
    for path in (home, home / "runs", home / "serve", stack_dir(), password_file(), mlflow_auth.auth_config("compose")):
        os.chown(path, IMAGE_UID, -1, follow_symlinks=False)
    for tree in (home / "data", home / "mlflow-artifacts"):
        for parent, folders, files in os.walk(tree):
            for name in [*folders, *files]:
                os.chown(Path(parent) / name, IMAGE_UID, -1, follow_symlinks=False)
        os.chown(tree, IMAGE_UID, -1, follow_symlinks=False)
    return IMAGE_UID


def container_gid() -> int:
    """The group the stack's containers run as: yours, never root's (group 0 would give them
    whatever the host's root group may read or write); the images' own where yours is root's."""
    return os.getgid() if os.getuid() != 0 and os.getgid() != 0 else IMAGE_GID


SERVE_TOKEN_FILE = "serve.json"


def serve_token_file() -> Path:
    """The endpoint's bearer token (``{"token": ...}``), generated once per HETFLOW_HOME, 0600."""
    generated_once(SERVE_TOKEN_FILE, lambda: {"token": secrets.token_urlsafe(32)})
    return stack_dir() / SERVE_TOKEN_FILE


def write_env_file(
    socket: Path,
    login: bool = True,
    airflow_port: int = 8080,
    mlflow_port: int = 5000,
    serve_port: int = TF_SERVING_REST_PORT,
) -> Path:
    """Write ``stack/compose.env`` (0600): every variable compose.yaml requires, the ports, and the
    images stack-images.sh built or chose (where it has run; compose.yaml's defaults otherwise)."""
    if not socket.exists():
        raise SystemExit(f"no Docker engine socket at {socket}: `make engine` starts an engine")
    keys = stack_secrets()
    # Fernet's format: 32 random bytes, URL-safe base64.
    fernet = generated_once("fernet.json", lambda: {"fernet_key": base64.urlsafe_b64encode(os.urandom(32)).decode()})
    mlflow_login = mlflow_auth.server_environment("compose")
    values = {
        "HETFLOW_HOME": str(hetflow_home()),
        "HETFLOW_UID": str(container_uid()),
        "HETFLOW_GID": str(container_gid()),
        "DOCKER_GID": str(socket.stat().st_gid),  # given to the scheduler only, which starts replicas
        "POSTGRES_PASSWORD": keys["postgres_password"],
        "AIRFLOW_JWT_SECRET": keys["jwt_secret"],
        "AIRFLOW_API_SECRET_KEY": keys["api_secret_key"],
        "AIRFLOW_FERNET_KEY": fernet["fernet_key"],
        "AIRFLOW_PASSWORDS_FILE": str(password_file()),
        "AIRFLOW_ALL_ADMINS": "False" if login else "True",
        "MLFLOW_AUTH_CONFIG": mlflow_login["MLFLOW_AUTH_CONFIG_PATH"],
        "MLFLOW_ADMIN_PASSWORD": mlflow_login["MLFLOW_AUTH_ADMIN_PASSWORD"],
        "MLFLOW_FLASK_SECRET_KEY": mlflow_login["MLFLOW_FLASK_SERVER_SECRET_KEY"],
        # One line: an env file holds one variable a line.
        "AIRFLOW_UI_THEME": json.dumps(json.loads((REPO_ROOT / "plugins" / "ui_theme.json").read_text())),
        "AIRFLOW_PORT": str(airflow_port),
        "MLFLOW_PORT": str(mlflow_port),
        "SERVE_PORT": str(serve_port),
        "SERVE_TOKEN": json.loads(serve_token_file().read_text())["token"],
    }
    if IMAGES_FILE.exists():
        values.update(line.split("=", 1) for line in IMAGES_FILE.read_text().splitlines() if "=" in line)
    write_private(env_file(), "".join(f"{name}={value}\n" for name, value in values.items()))
    return env_file()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack.compose_env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-login", action="store_true", help="everyone is admin: local development only")
    parser.add_argument("--airflow-port", type=int, default=8080)
    parser.add_argument("--mlflow-port", type=int, default=5000)
    parser.add_argument("--serve-port", type=int, default=TF_SERVING_REST_PORT, help="the endpoint's (hetflow serve)")
    parser.add_argument("--healthy-after", type=int, metavar="SECONDS", help="the stack is up: say where it is")
    args = parser.parse_args(argv)
    path = write_env_file(DOCKER_SOCKET, not args.no_login, args.airflow_port, args.mlflow_port, args.serve_port)
    values = dict(line.split("=", 1) for line in path.read_text().splitlines())
    if args.healthy_after is None:
        print(f"compose env file: {path} (yours only)")
    else:
        postgres = values.get("POSTGRES_IMAGE", "compose.yaml's default")
        print(f"hetflow compose stack healthy in {args.healthy_after} s (PostgreSQL image {postgres})")
    airflow, mlflow = f"http://127.0.0.1:{args.airflow_port}", f"http://127.0.0.1:{args.mlflow_port}"
    if args.no_login:
        print(f"  Airflow  {airflow}: login off (LOGIN=off): everyone is admin — local development only")
    else:  # the password itself is never printed: terminals and CI jobs keep their output
        print(f"  Airflow  {airflow}: log in as admin, password in {password_file()} (yours only)")
    endpoint = f"http://127.0.0.1:{args.serve_port}/v1/models/<name>:predict"
    print(f"  Endpoint {endpoint}: TF Serving's REST API (hetflow serve), each registered model's champion")
    print(f"           send Authorization: Bearer <token>, the token in {serve_token_file()} (yours only)")
    if args.healthy_after is not None:
        artifacts = Path(values["HETFLOW_HOME"]) / "mlflow-artifacts"
        print(f"  MLflow   {mlflow}: PostgreSQL store, artifacts in {artifacts}")
        print(f"           log in as admin, password (admin_password) in {mlflow_auth.credentials_file()} (yours only)")
        # As make up's: hetflow's experiment on its runs, not MLflow's GenAI view; the store is the server,
        # which answers its admin only.
        os.environ.update(mlflow_auth.client_environment())
        print(f"           hetflow's runs: {runs_page(mlflow, store=mlflow)}")
        print(f"           their key metrics: {runs_page(mlflow, key_metrics=True, store=mlflow)}")
        volume = f"{os.environ.get('COMPOSE_PROJECT_NAME', PROJECT)}_postgres-data"
        print(f"  stop with: make down-docker (the volume {volume} keeps Airflow's and MLflow's databases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

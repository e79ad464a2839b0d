"""``make up-docker``'s env file: the secrets and settings docker/compose.yaml is started with.

The compose stack takes the secrets ``make up`` generates for this HETFLOW_HOME (``devstack.secrets``:
once, into ``$HETFLOW_HOME/stack/``, folder 0700, files 0600), plus a Fernet key that its Airflow
containers, each with an Airflow home of its own, must share. The env file is rewritten on every
start from those files, so the values stay the same. The admin's password stays in
``stack/passwords.json``, which the api-server reads through the bind-mounted HETFLOW_HOME: the
env file names that file, and nothing prints the password.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from pathlib import Path

# make up's own secrets, so both stacks make and keep their secrets one way.
from devstack.secrets import generated_once, password_file, stack_dir, stack_secrets, write_private
from tasks.paths import REPO_ROOT, hetflow_home

DOCKER_SOCKET = Path("/var/run/docker.sock")


def env_file() -> Path:
    return stack_dir() / "compose.env"


def write_env_file(socket: Path, login: bool = True) -> Path:
    """Write ``stack/compose.env`` (0600): every variable compose.yaml requires."""
    if not socket.exists():
        raise SystemExit(f"no Docker engine socket at {socket}: `make engine` starts an engine")
    keys = stack_secrets()
    # Fernet's format: 32 random bytes, URL-safe base64.
    fernet = generated_once("fernet.json", lambda: {"fernet_key": base64.urlsafe_b64encode(os.urandom(32)).decode()})
    values = {
        "HETFLOW_HOME": str(hetflow_home()),
        "HETFLOW_UID": str(os.getuid()),
        "DOCKER_GID": str(socket.stat().st_gid),  # given to the scheduler only, which starts replicas
        "POSTGRES_PASSWORD": keys["postgres_password"],
        "AIRFLOW_JWT_SECRET": keys["jwt_secret"],
        "AIRFLOW_API_SECRET_KEY": keys["api_secret_key"],
        "AIRFLOW_FERNET_KEY": fernet["fernet_key"],
        "AIRFLOW_PASSWORDS_FILE": str(password_file()),
        "AIRFLOW_ALL_ADMINS": "False" if login else "True",
        # One line: an env file holds one variable a line.
        "AIRFLOW_UI_THEME": json.dumps(json.loads((REPO_ROOT / "plugins" / "ui_theme.json").read_text())),
    }
    write_private(env_file(), "".join(f"{name}={value}\n" for name, value in values.items()))
    return env_file()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack.compose_env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-login", action="store_true", help="everyone is admin: local development only")
    args = parser.parse_args(argv)
    path = write_env_file(DOCKER_SOCKET, login=not args.no_login)
    print(f"compose env file: {path} (yours only)")
    if args.no_login:
        print("Airflow http://127.0.0.1:8080: login off (LOGIN=off): everyone is admin — local development only")
    else:  # the password itself is never printed: terminals and CI jobs keep their output
        print(f"Airflow http://127.0.0.1:8080: log in as admin, password in {password_file()} (yours only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

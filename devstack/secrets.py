"""The stack's folder, ``$HETFLOW_HOME/stack/``, and the secrets in it, readable by their owner only.

Both stacks (``make up`` and ``make up-docker``) make and keep their secrets here, one way: each
generated on first use, kept out of the repo and re-used after. The admin's password is handed to
Airflow in a file and never printed or logged.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Callable

from hetflow.paths import hetflow_home


def stack_dir() -> Path:
    return hetflow_home() / "stack"


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def open_private(path: Path, flags: int) -> int:
    """Open (creating) a file only its owner can read; one left more open by an older hetflow is
    closed down too."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600)
    os.fchmod(descriptor, 0o600)
    return descriptor


def write_private(path: Path, text: str) -> None:
    with os.fdopen(open_private(path, os.O_TRUNC), "w") as file:
        file.write(text)


def generated_once(name: str, values: Callable[[], dict[str, str]]) -> dict[str, str]:
    """Secrets in ``stack/<name>``, generated on first use and kept out of the repo."""
    path = private_dir(stack_dir()) / name
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

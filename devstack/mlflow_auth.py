"""The MLflow server's login, for both stacks: MLflow's basic-auth app, one admin, no permission for
anyone else.

Without it every local user (and every process of the host) could read the registry through the
server on 127.0.0.1 and move ``champion`` with one REST call. The admin's password and the key the
login app signs its forms with are generated once per HETFLOW_HOME into ``stack/mlflow.json``
(``devstack.secrets``: folder 0700, file 0600) and never printed. The server gets them in its
environment, with ``MLFLOW_AUTH_CONFIG_PATH`` naming its settings; a client (the compose stack's
tasks, a test, a user's script) in ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from devstack.secrets import generated_once, private_dir, stack_dir, write_private

ADMIN = "admin"


def credentials_file() -> Path:
    """Where the MLflow admin's password is (``admin_password``), readable by its owner only."""
    return stack_dir() / "mlflow.json"


def mlflow_secrets() -> dict[str, str]:
    return generated_once(
        credentials_file().name,
        lambda: {"admin_password": secrets.token_urlsafe(16), "flask_secret_key": secrets.token_urlsafe(32)},
    )


def auth_config(stack: str) -> Path:
    """The login app's settings for ``stack`` (``up`` or ``compose``), 0600: users other than the admin
    get no permission; the users are kept in ``stack/mlflow-users-<stack>.db``, one per stack, since the
    compose stack's server may run as another uid than make up's."""
    path = private_dir(stack_dir()) / f"mlflow-auth-{stack}.ini"
    users = stack_dir() / f"mlflow-users-{stack}.db"
    write_private(
        path,
        "[mlflow]\n"
        "default_permission = NO_PERMISSIONS\n"
        f"database_uri = sqlite:///{users}\n"
        f"admin_username = {ADMIN}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n",
    )
    return path


def server_environment(stack: str) -> dict[str, str]:
    """What ``mlflow server --app-name basic-auth`` needs besides its command line."""
    keys = mlflow_secrets()
    return {
        "MLFLOW_AUTH_CONFIG_PATH": str(auth_config(stack)),
        # Used once, when the users' store is new; not on the command line, which `ps` shows everyone.
        "MLFLOW_AUTH_ADMIN_PASSWORD": keys["admin_password"],
        "MLFLOW_FLASK_SERVER_SECRET_KEY": keys["flask_secret_key"],
    }


def client_environment() -> dict[str, str]:
    """What an MLflow client sends to the server: the admin's login."""
    return {"MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": mlflow_secrets()["admin_password"]}

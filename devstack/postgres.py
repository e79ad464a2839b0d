"""Debian's PostgreSQL as Airflow's metadata DB (``make up DB=postgres``): a role and a database for
each HETFLOW_HOME on the local cluster, which is started if it is down and then stopped by ``down``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess

from hetflow.paths import hetflow_home


def _admin(*command: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run a command as Debian's ``postgres`` superuser (peer authentication on the local socket)."""
    become = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else ["sudo", "-n", "-u", "postgres"]
    return subprocess.run([*become, *command], input=stdin, check=True, capture_output=True, text=True)


def start_postgres(password: str) -> tuple[str, str | None]:
    """Start Debian's PostgreSQL cluster if it is down; make a role and a database for this
    HETFLOW_HOME. Returns the SQLAlchemy URL and the cluster we started (None if it was running)."""
    clusters = subprocess.run(["pg_lsclusters", "--no-header"], check=True, capture_output=True, text=True)
    version, name, port, status = clusters.stdout.split()[:4]
    started = None
    if status != "online":
        subprocess.run(["pg_ctlcluster", version, name, "start"], check=True)
        started = f"{version}/{name}"
    database = "hetflow_" + hashlib.sha256(str(hetflow_home()).encode()).hexdigest()[:10]
    if not _admin("psql", "-tAc", "SELECT 1 FROM pg_roles WHERE rolname = 'hetflow'").stdout.strip():
        _admin("psql", "-c", "CREATE ROLE hetflow LOGIN")
    # On stdin: a command line is visible to every user in `ps`.
    _admin("psql", "-v", "ON_ERROR_STOP=1", stdin=f"ALTER ROLE hetflow PASSWORD '{password}'")
    if not _admin("psql", "-tAc", f"SELECT 1 FROM pg_database WHERE datname = '{database}'").stdout.strip():
        _admin("createdb", "--owner=hetflow", database)
    return f"postgresql+psycopg2://hetflow:{password}@127.0.0.1:{port}/{database}", started


def stop_postgres(cluster: str) -> None:
    """Stop the cluster ``start_postgres`` started (its ``version/name``)."""
    subprocess.run(["pg_ctlcluster", *cluster.split("/"), "stop"], check=True)

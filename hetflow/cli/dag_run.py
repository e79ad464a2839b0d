"""``hetflow run``'s way through Airflow: hetflow's Airflow settings, and one run of
hetflow_train in this process (``dag.test``), its output to a log file and a live view to the
terminal."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hetflow.paths import REPO_ROOT, hetflow_home, run_paths

DAG_ID = "hetflow_train"


def airflow_environment() -> dict[str, str]:
    """Airflow settings for hetflow's own Airflow home (a metadata DB per HETFLOW_HOME)."""
    return {
        "AIRFLOW_HOME": str(hetflow_home() / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO_ROOT / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        # The default pre-forks 32 workers (~6 GB); 2 cores need a handful.
        "AIRFLOW__CORE__PARALLELISM": "4",
    }


def ensure_airflow_db() -> None:
    """Create Airflow's metadata DB on first use (``airflow db migrate`` is idempotent but slow).

    Under an exclusive lock, and done only once a marker says a migration finished: two ``hetflow
    run`` started together on an empty home both migrated at once ("table team already exists"),
    and the DB file exists from a migration's first statement, long before it is usable."""
    home = Path(os.environ["AIRFLOW_HOME"])
    migrated = home / ".hetflow-migrated"
    if migrated.exists():
        return
    with _exclusive(home / ".hetflow-migrate.lock"):
        if migrated.exists():  # another process migrated while this one waited
            return
        print(f"creating the Airflow metadata DB in {home} ...", flush=True)
        subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, stdout=subprocess.DEVNULL)
        migrated.touch()


def ensure_dags_in_db(dag_ids: Iterable[str]) -> None:
    """Write the DAG folder's DAGs into Airflow's metadata DB, under an exclusive lock, unless every
    one of ``dag_ids`` is there already.

    ``dag.test`` writes them too, unlocked: two first ``hetflow run`` on one home both inserted
    hetflow_train, and one failed ("UNIQUE constraint failed: dag.dag_id"). Once the rows exist,
    its writes are updates, which SQLite serializes."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import BundleDagBag, sync_bag_to_db
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    wanted = set(dag_ids)
    with _exclusive(Path(os.environ["AIRFLOW_HOME"]) / ".hetflow-dag-sync.lock"), create_session() as session:
        if set(session.scalars(select(DagModel.dag_id).where(DagModel.dag_id.in_(wanted)))) == wanted:
            return
        manager = DagBundlesManager()
        manager.sync_bundles_to_db(session=session)
        session.commit()
        for bundle in manager.get_all_dag_bundles():
            bundle.initialize()
            bag = BundleDagBag(bundle.path, bundle_path=bundle.path, bundle_name=bundle.name)
            sync_bag_to_db(bag, bundle.name, bundle.version, session=session)


def ensure_mlflow_store() -> None:
    """Where the MLflow store is a SQLite file, create its tables and hetflow's experiment before the
    DAG runs, under an exclusive lock beside it: two first runs on an empty store both created them
    in their register stages, and one failed ("table evaluation_datasets already exists")."""
    from hetflow.registry import store

    uri = store.tracking_uri()
    if not uri.startswith("sqlite:///"):
        return  # a tracking server serves concurrent clients itself

    database = Path(uri.removeprefix("sqlite:///"))
    with _exclusive(database.with_name(f"{database.name}.hetflow-lock")):
        store.ensure_experiment(store.client(uri))


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """An exclusive lock between processes, held while the block runs; the kernel releases it when
    its holder dies."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run_dag(conf: dict[str, Any], log_file: Path | None = None, dag_id: str = DAG_ID) -> Path:
    """Run a DAG (hetflow_train, or hetflow_tune) once with ``conf`` through Airflow's ``dag.test``;
    return summary.json's path.

    :param log_file: where everything the run prints goes, the terminal showing only the live view
        (``hetflow.cli.live_view``); None prints it all as it comes.
    """
    for key, value in airflow_environment().items():
        os.environ.setdefault(key, value)
    ensure_airflow_db()
    ensure_mlflow_store()
    with _output_to(log_file) if log_file else contextlib.nullcontext() as terminal:
        from airflow.dag_processing.dagbag import DagBag  # sets up Airflow's logging: the view comes after

        with _live_view(terminal) if terminal else contextlib.nullcontext():
            bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
            if bag.import_errors:
                raise RuntimeError(f"DAG import errors: {bag.import_errors}")
            ensure_dags_in_db(bag.dag_ids)
            dag_run = bag.get_dag(dag_id).test(run_conf=conf)
    return run_paths(dag_run.run_id).summary


@contextlib.contextmanager
def _output_to(log_file: Path):
    """Send this process's stdout and stderr (Airflow's structured log, TensorFlow's C++ log, TFDS'
    progress bars: they write there in ways no logging handler sees) to ``log_file``; yield the
    terminal."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    target = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    try:
        yield terminal
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        terminal.close()


@contextlib.contextmanager
def _live_view(terminal):
    from hetflow.cli.live_view import LiveView

    view = LiveView(terminal)
    logging.getLogger().addHandler(view)
    try:
        yield
    finally:
        logging.getLogger().removeHandler(view)

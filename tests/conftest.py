"""Shared fixtures: an isolated HETFLOW_HOME and MLflow store per test session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["replica_guard", "mlflow_hosts", "ui_stack"]  # their fixtures serve several test modules


@pytest.fixture(scope="session")
def hetflow_env(tmp_path_factory) -> dict[str, str]:
    """Environment for hetflow commands: its own home, data dir, Airflow DB and MLflow store."""
    home = tmp_path_factory.mktemp("hetflow_home")
    (home / "mlflow").mkdir()
    env = {
        "HETFLOW_HOME": str(home),
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow' / 'mlflow.db'}",
    }
    os.environ.update(env)  # for what the test process itself uses (MlflowClient, hetflow.paths, Airflow)
    from hetflow.cli.dag_run import airflow_environment

    os.environ.update(airflow_environment())
    return dict(os.environ)


def hetflow(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the ``hetflow`` command as a user would, capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "hetflow.cli.main", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


E2E_MODEL = "e2e-digits"
# The stages after training at their least (no pruning, no TFLite): for DAG runs that test what comes
# before them; the default run (e2e_first_run) and the compression tests keep them whole.
NO_COMPRESSION = ("prune=false", "quantize=none", 'export_formats=["saved_model"]')

# A study of two trials side by side, each a model that trains in seconds: `hetflow tune`'s JSON and
# hetflow_tune's conf alike (test_e2e_tune.py, test_e2e_ui_tune.py).
TUNE_STUDY = {
    "strategy": ["multi_worker_mirrored", "parameter_server"],
    "workers": [2],
    "learning_rate_range": [0.002, 0.01],
    "target_accuracy": 0.85,
    "trials": 2,
    "parallel_trials": 2,
    "base": {"model": "mlp", "epochs": 8, "prune": False, "registered_model": "tuned-digits"},
}


def run_dag(env: dict[str, str], *sets: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`hetflow run` registering into E2E_MODEL with ``sets`` (KEY=VALUE); its output and summary."""
    return dag_run(env, f"registered_model={E2E_MODEL}", *sets)


def dag_run(env: dict[str, str], *sets: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, dict]:
    """`hetflow run` with ``sets`` (KEY=VALUE); its output and summary."""
    args = ["run"]
    for assignment in sets:
        args += ["--set", assignment]
    done = hetflow(env, *args, timeout=timeout)
    summary_path = Path(done.stdout.strip().splitlines()[-1])
    assert summary_path.name == "summary.json", done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(summary_path.read_text())


@pytest.fixture(scope="session")
def e2e_first_run(hetflow_env) -> tuple[subprocess.CompletedProcess, dict]:
    """The first run of the end-to-end tests (the defaults, 15 epochs), made once for every test
    file that reads a real run (test_e2e_run, test_pipeline_timing)."""
    return run_dag(hetflow_env, "epochs=15")


def full_log(done: subprocess.CompletedProcess) -> str:
    """The whole log of a `hetflow run` (its terminal shows the live view; the rest is in a file
    whose path it prints)."""
    line = next(line for line in done.stdout.splitlines() if line.strip().startswith("full log"))
    return Path(line.split(maxsplit=2)[2]).read_text()


# The first lines of a probe run in a sandbox: attempt(label, action) does one thing and prints one
# line, "ok" or the OSError's class and errno.
ATTEMPT = textwrap.dedent(
    """
    def attempt(label, action):
        try:
            action()
            print(label, "ok")
        except OSError as error:
            print(label, type(error).__name__, error.errno)
    """
)


def run_sandboxed(box, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """``argv`` run in ``box`` (a ``hetflow.sandbox.Sandbox``), its output captured; the box closed."""
    try:
        return subprocess.run(box.command(argv), pass_fds=box.fds, capture_output=True, text=True, timeout=timeout)
    finally:
        box.close()


def replica_sandbox(run_id: str, *folders: str):
    """A 2-worker sync run's directory set up as provisioning leaves it (the spec, its folders and
    ``folders`` besides, the output folder handed over) and a sandbox with a replica's view of it,
    less its network: ``(paths, box)``."""
    from hetflow import sandbox
    from hetflow.cluster.backends.local.replicas import file_view
    from hetflow.cluster.replica_view import hand_over_writable, provisioned_directories
    from hetflow.paths import create_run_dir, write_record
    from hetflow.spec import parse_spec

    spec = parse_spec({"strategy": "multi_worker_mirrored", "workers": 2})
    paths = create_run_dir(run_id)
    write_record(paths.spec, spec.model_dump(mode="json"))
    for directory in [*provisioned_directories(paths), *(paths.root / folder for folder in folders)]:
        directory.mkdir(parents=True, exist_ok=True)
    hand_over_writable(paths)
    view = file_view(spec, paths.root)
    return paths, sandbox.Sandbox(view["read_write"], view["read_only"], view["hidden"])


def run_sandboxed_around(box, argv: list[str], meanwhile, timeout: float = 60) -> subprocess.CompletedProcess:
    """``argv`` run in ``box`` until it prints ``ready ok``; then ``meanwhile()`` runs (what the
    pipeline writes while a replica lives) and the process goes on once sent a line; its whole output
    captured, the box closed."""
    try:
        process = subprocess.Popen(
            box.command(argv), pass_fds=box.fds, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        before = []
        while (line := process.stdout.readline()) not in ("", "ready ok\n"):  # "": it ended early
            before.append(line)
        meanwhile()
        out, err = process.communicate("go\n", timeout=timeout)
    finally:
        box.close()
    return subprocess.CompletedProcess(argv, process.returncode, "".join([*before, out]), err)


def wait_for(predicate, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def listening(address: str) -> bool:
    """A socket in LISTEN state on the port, on any interface (TF servers bind 0.0.0.0).

    Asked of the kernel, not by connecting: a connect to a free ephemeral port can connect to
    itself (TCP simultaneous open) and look like a listener."""
    port = int(address.rsplit(":", 1)[1])
    return any(c.laddr.port == port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN)


@pytest.fixture()
def provisioned(hetflow_env, request):
    """Makes runs with a validated spec (long training by default) and prepared data, provisioned;
    tears them all down after the test."""
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.provision_cluster import provision_cluster
    from hetflow.tasks.teardown_cluster import teardown_cluster
    from hetflow.tasks.validate_spec import validate_spec

    made = []

    def provision(**values) -> str:
        run = f"test_{request.node.name}_{len(made)}_{os.getpid()}"
        validate_spec({"epochs": 1000, **values}, run)
        prepare_data(run)
        made.append(run)  # before provisioning: a half-provisioned run is torn down too
        provision_cluster(run)
        return run

    yield provision
    for run in made:
        teardown_cluster(run)


def replica_listening(cluster: dict, address: str) -> bool:
    """Whether a replica of the run whose ``cluster.json`` is ``cluster`` listens on ``address``'s
    port: inside the run's network namespace where it has one (sandboxed local replicas: seen from
    the run's live replicas), else on this host. A namespace no replica is left in has nothing
    listening."""
    if cluster.get("network_isolation", {}).get("sandbox") is None:
        return listening(address)
    from hetflow.cluster.processes import run_replicas

    table = ""
    for pid in run_replicas(cluster["run_id"]).values():
        for name in ("tcp", "tcp6"):
            try:
                table += Path(f"/proc/{pid}/net/{name}").read_text()
            except OSError:
                pass
    port = int(address.rsplit(":", 1)[1])
    # Columns: sl, local address (hex ip:hex port), remote address, state (0A: LISTEN), ...
    return any(
        fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port
        for fields in (line.split() for line in table.splitlines()[1:])
        if len(fields) > 3 and ":" in fields[1]
    )


@pytest.fixture(scope="session")
def docker_client():
    """The Docker engine that `make test` started (docker/engine.sh), with the replica image that it
    built; the container tests skip, saying why, where no engine answers."""
    import docker

    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as error:
        pytest.skip(f"no Docker engine answers ({error}); docker/engine.sh says why it could not start one")
    try:
        client.images.get("hetflow-replica:0.1.0")
    except docker.errors.ImageNotFound:  # a bare pytest run: build it as `make test` does
        subprocess.run([REPO / "docker/build-image.sh"], check=True)
    return client

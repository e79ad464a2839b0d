"""The trust boundary around what others wrote: a hostile process in a local replica's sandbox and a
hostile registered model in the served check's model server try what an attacker would (root's
kernel knobs, the Docker socket, password hashes, signalling the host's processes, other runs, the
stack's secrets, the pipeline's records, the host's network) and reach none of it, while the run's
replicas still reach each other. Real bubblewrap sandboxes, real replicas, a real model server."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import ATTEMPT, wait_for

from hetflow import sandbox
from hetflow.cluster.processes import run_replicas
from hetflow.paths import hetflow_home, run_paths

# Tries each thing, and prints one line per attempt: "ok" or the error's class and errno.
_PROBE = ATTEMPT + textwrap.dedent(
    """
    import json, os, socket, sys, time
    targets = json.loads(sys.argv[1])
    def connect_unix(path):
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)
    def connect_tcp(port, patience=0):
        deadline = time.monotonic() + patience  # a peer's TF server listens once TensorFlow is imported
        while True:
            try:
                return socket.create_connection(("127.0.0.1", port), timeout=3).close()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    attempt("core-pattern", lambda: open("/proc/sys/kernel/core_pattern", "w").close())
    attempt("docker-socket", lambda: connect_unix("/var/run/docker.sock"))
    attempt("shadow", lambda: open("/etc/shadow").read())
    attempt("signal-host-process", lambda: os.kill(targets["host_pid"], 0))
    attempt("other-run", lambda: os.listdir(targets["other_run"]))
    attempt("stack-secret", lambda: open(targets["secret"]).read())
    attempt("host-listener", lambda: connect_tcp(targets["host_port"]))
    attempt("peer-replica", lambda: connect_tcp(targets["peer_port"], patience=90))
    attempt("write-run", lambda: open(targets["forged"], "w").write("{}"))
    attempt("write-spec", lambda: open(targets["spec"], "a").write("{}"))
    attempt("replace-cluster", lambda: os.replace(targets["forged"], targets["cluster"]))
    attempt("write-repo", lambda: open(targets["repo_file"], "w").write("x"))
    print("pid-1", open("/proc/1/cmdline", "rb").read().split(b"\\0")[0].decode())
    print("uid", os.getuid())
    print("caps", [line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff")][0])
    print("home", json.dumps(sorted(os.listdir(targets["home"]))))
    """
)


def _host_listener() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener


def _refused(outcome: str) -> bool:
    return outcome != "ok"


@pytest.mark.replicas
def test_a_hostile_process_in_a_replicas_sandbox_reaches_nothing_but_its_peers(provisioned, monkeypatch, tmp_path):
    from hetflow.cluster.backends.local import keeper
    from hetflow.cluster.backends.local.replicas import file_view
    from hetflow.pipeline.attempts import load_spec

    home = hetflow_home()
    other_run = home / "runs" / "someone_else"
    other_run.mkdir(parents=True, exist_ok=True)
    (other_run / "summary.json").write_text("{}")
    (home / "stack").mkdir(exist_ok=True)
    (home / "stack" / "secrets.json").write_text('{"password": "secret"}')
    # Under `make up` the task's environment holds Airflow's secrets: a replica must not inherit them.
    monkeypatch.setenv("AIRFLOW__API_AUTH__JWT_SECRET", "not-for-replicas")

    run_id = provisioned(strategy="multi_worker_mirrored", workers=2)
    paths = run_paths(run_id)
    cluster = json.loads(paths.cluster.read_text())
    assert cluster["network_isolation"] == {"isolated": True, "sandbox": "bubblewrap"}
    assert wait_for(lambda: len(run_replicas(run_id)) == 2, timeout=60)
    replica = run_replicas(run_id)["worker-0"]
    environment = Path(f"/proc/{replica}/environ").read_bytes().split(b"\0")
    assert not any(entry.startswith(b"AIRFLOW__") for entry in environment)
    assert f"HETFLOW_RUN_ID={run_id}".encode() in environment

    peer_port = int(cluster["replicas"][1]["address"].rsplit(":", 1)[1])
    listener = _host_listener()
    targets = {
        "host_pid": os.getpid(),
        "other_run": str(other_run),
        "secret": str(home / "stack" / "secrets.json"),
        "host_port": listener.getsockname()[1],
        "peer_port": peer_port,
        "spec": str(paths.spec),
        "cluster": str(paths.cluster),
        "forged": str(paths.output / "forged.json"),
        "repo_file": str(Path(keeper.__file__).parent / "planted.py"),
        "home": os.path.expanduser("~"),
    }
    # The sandbox the keeper gives every replica of the run, with a hostile command in it.
    view = file_view(load_spec(paths), paths.root)
    view = keeper.View(view["read_write"], view["read_only"], view["hidden"])
    box = keeper.replica_sandbox(view, paths.root)
    command = box.command([sys.executable, "-c", _PROBE, json.dumps(targets)])
    try:
        done = subprocess.run(
            command, pass_fds=box.fds, env=keeper.replica_environment(), capture_output=True, text=True, timeout=120
        )
    finally:
        box.close()
        listener.close()
    assert done.returncode == 0, done.stderr
    seen = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    for attack in ("core-pattern", "docker-socket", "shadow", "signal-host-process", "other-run", "stack-secret"):
        assert _refused(seen[attack]), f"{attack}: {seen[attack]}"
    assert _refused(seen["host-listener"])  # its network is the run's, not the host's
    assert seen["peer-replica"] == "ok", "the run's replicas must reach each other"
    assert _refused(seen["write-spec"]) and _refused(seen["replace-cluster"]) and _refused(seen["write-repo"])
    assert seen["write-run"] == "ok"  # its run's output folder is where it writes
    assert json.loads(paths.cluster.read_text()) == cluster
    assert not Path(targets["repo_file"]).exists()
    host_init = Path("/proc/1/cmdline").read_bytes().split(b"\0")[0].decode()
    assert seen["pid-1"] != host_init  # a pid namespace of its own
    assert seen["uid"] != "0" and seen["caps"] == "0000000000000000"
    # Of the user's home, only the way to what it must run (an interpreter installed there) exists.
    shown_parts = {part for path in (sys.prefix, sys.base_prefix) for part in Path(os.path.realpath(path)).parts}
    assert set(json.loads(seen["home"])) <= shown_parts


# A registered model "from code" that, when asked, tries what a hostile model would; 1.0: it could.
_HOSTILE_MODEL = textwrap.dedent(
    """
    import os, socket
    import mlflow
    from mlflow.pyfunc import PythonModel

    def could(action):
        try:
            action()
            return 1.0
        except OSError:
            return 0.0

    def connect_unix(path):
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(path)

    class Hostile(PythonModel):
        def predict(self, context, model_input, params=None):
            return [[
                could(lambda: open("/proc/sys/kernel/core_pattern", "w").close()),
                could(lambda: connect_unix("/var/run/docker.sock")),
                could(lambda: open("/etc/shadow").read()),
                could(lambda: os.kill({host_pid}, 0)),
                could(lambda: os.listdir({other_run!r})),
                could(lambda: open({secret!r}).read()),
                could(lambda: open({store!r} + "/planted", "w").write("x")),
                could(lambda: socket.create_connection(("127.0.0.1", {host_port}), timeout=3).close()),
                float(os.getuid() == 0),
            ]] * len(model_input)

    mlflow.models.set_model(Hostile())
    """
)


@pytest.mark.slow
def test_a_hostile_registered_model_reaches_nothing_from_its_server(hetflow_env, tmp_path):
    import numpy as np

    import mlflow
    from hetflow.serving.server import ModelServer

    home, store = hetflow_home(), Path(hetflow_env["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///")).parent
    other_run = home / "runs" / "someone_else"
    other_run.mkdir(parents=True, exist_ok=True)
    (home / "stack").mkdir(exist_ok=True)
    (home / "stack" / "secrets.json").write_text('{"password": "secret"}')
    listener = _host_listener()
    code = tmp_path / "hostile.py"
    code.write_text(
        _HOSTILE_MODEL.format(
            host_pid=os.getpid(),
            other_run=str(other_run),
            secret=str(home / "stack" / "secrets.json"),
            store=str(store),
            host_port=listener.getsockname()[1],
        )
    )
    experiment = mlflow.get_experiment_by_name("hostile") or mlflow.get_experiment(
        mlflow.create_experiment("hostile", artifact_location=(store / "hostile-artifacts").as_uri())
    )
    with mlflow.start_run(experiment_id=experiment.experiment_id):
        logged = mlflow.pyfunc.log_model(name="model", python_model=str(code), registered_model_name="hostile")
    try:
        uri = f"models:/hostile/{logged.registered_model_version}"
        with ModelServer(uri, hetflow_env["MLFLOW_TRACKING_URI"], tmp_path / "s.log") as server:
            tried = server.predict(np.zeros((1, 4), np.float32))
    finally:
        listener.close()
    assert server.isolation["confined"] is True and server.isolation["sandbox"] == "bubblewrap"
    assert tried.tolist() == [[0.0] * 9]  # reached nothing, and not root
    assert not (store / "planted").exists()


def test_without_a_sandbox_a_run_is_refused_unless_the_operator_accepts_it(hetflow_env, monkeypatch):
    """No bwrap on PATH: provisioning refuses, one line naming the setting; with the setting, the
    replicas run unisolated and the run says so."""
    from hetflow.cluster.backends.local.replicas import LocalReplicas
    from hetflow.cluster.layout import plan_cluster
    from hetflow.spec import RunSpec

    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox.unavailable.cache_clear()
    try:
        spec = RunSpec()
        with pytest.raises(sandbox.SandboxUnavailable) as refused:
            LocalReplicas(plan_cluster(spec, "refused-run"), spec, run_paths("refused-run").root)
        message = str(refused.value)
        assert "\n" not in message and "no `bwrap` on PATH" in message and "HETFLOW_ALLOW_UNISOLATED=1" in message
        monkeypatch.setenv(sandbox.ALLOW_UNISOLATED_ENV, "1")
        accepted = LocalReplicas(plan_cluster(spec, "accepted-run"), spec, run_paths("accepted-run").root)
        assert accepted.sandboxed is False
    finally:
        sandbox.unavailable.cache_clear()


_UNPRIVILEGED = textwrap.dedent(
    """
    import json, os, subprocess, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from hetflow import sandbox
    from hetflow.cluster.backends.local import netns
    run = Path(sys.argv[2])
    (run / "replicas").mkdir()
    with open(run / "holder.log", "ab") as log:
        holder = netns.hold(run, log, {"PATH": "/usr/bin:/bin"})
    probe = (
        "import os; status = open('/proc/self/status').read()\\n"
        "try:\\n open('/proc/sys/kernel/core_pattern', 'w')\\nexcept OSError as error: core = error.errno\\n"
        "print(os.getuid(), status.split('CapEff:')[1].split()[0], os.path.exists('/var/run/docker.sock'), core)"
    )
    try:
        box = sandbox.Sandbox(read_write=[str(run)], network=netns.join(run))
        command = box.command([sys.executable, "-c", probe])
        done = subprocess.run(command, pass_fds=box.fds, capture_output=True, text=True)
        print(done.stdout.strip() or done.stderr)
    finally:
        holder.kill()
    """
)


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/python3").exists(), reason="needs root to become nobody")
def test_the_sandbox_and_the_runs_network_work_when_hetflow_is_not_root():
    """As an unprivileged user (nobody, with the system's Python: root's interpreter is out of its
    reach), the same sandbox and network holder: bubblewrap needs no root here. The user runs its own
    copy of the code, as a non-root install must be where its user can read it: this checkout may be
    in a directory only root can enter (a clone under /root, or in `mktemp -d`)."""
    top = Path(tempfile.mkdtemp(prefix="hetflow-unprivileged-"))  # pytest's tmp_path is root's alone
    os.chmod(top, 0o755)
    shutil.copytree(
        Path(sandbox.__file__).parent, top / "code" / "hetflow", ignore=shutil.ignore_patterns("__pycache__")
    )
    run = top / "run"
    run.mkdir()
    os.chown(run, sandbox.SANDBOX_UID, sandbox.SANDBOX_GID)
    try:
        _run_as_nobody(run, top)
    finally:
        shutil.rmtree(top)


def _run_as_nobody(run: Path, top: Path) -> None:
    as_nobody = ["setpriv", f"--reuid={sandbox.SANDBOX_UID}", f"--regid={sandbox.SANDBOX_GID}", "--clear-groups"]
    environment = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "HETFLOW_HOME": str(top / "home")}
    done = subprocess.run(
        [*as_nobody, "/usr/bin/python3", "-c", _UNPRIVILEGED, str(top / "code"), str(run)],
        env=environment,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(sandbox.SANDBOX_UID), "0000000000000000", "False", "13"]

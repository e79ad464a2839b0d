"""What a confined process sees of the file system (#17): local replicas see their run directory
(read-write) and the prepared data (read-only) of HETFLOW_HOME, nothing else of it, and can change
nothing outside their run directory and their own /tmp. Real processes in real mount namespaces;
the cases need root and ``unshare`` (they skip, saying why, without them)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO, wait_for

from tasks import confine
from tasks.cluster.processes import run_replicas
from tasks.paths import data_dir, hetflow_home, run_paths

needs_root = pytest.mark.skipif(confine.unavailable() is not None, reason=confine.unavailable() or "")

# Tries each write and read, and reports what happened, one line each.
_PROBE = textwrap.dedent(
    """
    import os, sys
    home, run, data = sys.argv[1:4]
    def attempt(label, action):
        try:
            action()
            print(label, "ok")
        except OSError as error:
            print(label, type(error).__name__, error.errno)
    attempt("write-run", lambda: open(os.path.join(run, "written"), "w").write("x"))
    attempt("write-data", lambda: open(os.path.join(data, "written"), "w").write("x"))
    attempt("write-home", lambda: open(os.path.join(home, "written"), "w").write("x"))
    attempt("write-repo", lambda: open(sys.argv[4], "w").write("x"))
    attempt("read-data", lambda: open(os.path.join(data, "shard")).read())
    attempt("read-secret", lambda: open(os.path.join(home, "stack", "compose.env")).read())
    attempt("read-other-run", lambda: os.listdir(os.path.join(home, "runs", "other")))
    attempt("init-environ", lambda: open("/proc/1/environ").read())
    attempt("write-tmp", lambda: open("/tmp/written", "w").write("x"))
    print("home", sorted(os.listdir(home)))
    print("caps", [line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff")][0])
    """
)


@needs_root
def test_a_confined_command_sees_only_what_it_is_shown_and_changes_only_what_it_may(tmp_path):
    home = tmp_path / "home"
    run, data, other = home / "runs" / "mine", home / "data", home / "runs" / "other"
    for directory in (run, data, other, home / "stack"):
        directory.mkdir(parents=True)
    (data / "shard").write_text("examples")
    (home / "stack" / "compose.env").write_text("AIRFLOW_PASSWORD=secret")
    planted_in_repo = REPO / f"planted-{tmp_path.name}"
    command = confine.confined(
        ["python3", "-c", _PROBE, str(home), str(run), str(data), str(planted_in_repo)],
        hide=[str(home)],
        read_write=[str(run)],
        read_only=[str(data)],
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert seen["write-run"] == "ok" and (run / "written").read_text() == "x"
    assert seen["write-data"] == "OSError 30"  # EROFS
    assert seen["write-home"] == "OSError 30"
    assert seen["write-repo"] == "OSError 30" and not planted_in_repo.exists()
    assert seen["read-data"] == "ok"
    assert seen["read-secret"] == "FileNotFoundError 2"
    assert seen["read-other-run"] == "FileNotFoundError 2"
    assert seen["init-environ"] == "PermissionError 13"  # no capabilities: no other process's secrets
    assert seen["write-tmp"] == "ok" and not Path("/tmp/written").exists()  # a /tmp of its own
    assert seen["home"] == "['data', 'runs']"
    assert seen["caps"] == "0000000000000000"
    # Nothing changed outside: the hidden directory is whole, the shown ones still in place.
    assert (home / "stack" / "compose.env").read_text() == "AIRFLOW_PASSWORD=secret" and other.is_dir()
    assert not (data / "written").exists() and not (home / "written").exists()


def _mount_options(pid: int) -> dict[str, str]:
    """Mount point -> per-mount options, as the process sees them."""
    lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    return {fields[4]: fields[5] for fields in (line.split() for line in lines)}


@needs_root
def test_a_local_replica_sees_its_run_directory_and_the_data_only(provisioned):
    home = hetflow_home()
    other_run = home / "runs" / "someone_else"
    other_run.mkdir(parents=True, exist_ok=True)
    (home / "stack").mkdir(exist_ok=True)
    (home / "stack" / "compose.env").write_text("AIRFLOW_PASSWORD=secret")

    run_id = provisioned(strategy="multi_worker_mirrored", workers=2)
    run_dir = run_paths(run_id).root
    record = json.loads(run_paths(run_id).cluster.read_text())["file_isolation"]
    assert record == {
        "confined": True,
        "hidden": [str(home), os.path.expanduser("~")],
        "read_write": [str(run_dir)],
        "read_only": [str(data_dir(home))],
    }
    assert wait_for(lambda: len(run_replicas(run_id)) == 2, timeout=60)
    replica = run_replicas(run_id)["worker-0"]
    # The replica's view, through its own root: HETFLOW_HOME holds the way to its run and the data.
    view = Path(f"/proc/{replica}/root")
    assert sorted(p.name for p in (view / home.relative_to("/")).iterdir()) == ["data", "runs"]
    assert [p.name for p in (view / home.relative_to("/") / "runs").iterdir()] == [run_dir.name]
    options = _mount_options(replica)
    assert options[str(run_dir)].startswith("rw")
    assert options[str(data_dir(home))].startswith("ro")
    assert options["/"].startswith("ro")
    status = Path(f"/proc/{replica}/status").read_text()
    assert "CapEff:\t0000000000000000" in status and "CapBnd:\t0000000000000000" in status
    # It writes into its run directory: its TF server came up and its log grows there.
    log = run_paths(run_id).logs / "worker-0.log"
    size = log.stat().st_size
    time.sleep(1)
    assert wait_for(lambda: log.stat().st_size > size, timeout=60)
    assert other_run.is_dir() and os.listdir(other_run) == []


# A registered model "from code" that, when loaded and asked, tries what a hostile model would:
# write into HETFLOW_HOME and the MLflow store, read the stack's secrets. 1.0: it could.
_HOSTILE_MODEL = textwrap.dedent(
    """
    import mlflow
    from mlflow.pyfunc import PythonModel

    def could(action):
        try:
            action()
            return 1.0
        except OSError:
            return 0.0

    class Hostile(PythonModel):
        def predict(self, context, model_input, params=None):
            return [[
                could(lambda: open({home!r} + "/planted", "w").write("x")),
                could(lambda: open({home!r} + "/stack/compose.env").read()),
                could(lambda: open({store!r} + "/planted", "w").write("x")),
            ]] * len(model_input)

    mlflow.models.set_model(Hostile())
    """
)


@needs_root
def test_a_served_model_that_runs_code_cannot_touch_the_pipelines_files(hetflow_env, tmp_path):
    import numpy as np

    import mlflow
    from tasks.serving import ModelServer

    home, store = hetflow_home(), Path(hetflow_env["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///")).parent
    (home / "stack").mkdir(exist_ok=True)
    (home / "stack" / "compose.env").write_text("AIRFLOW_PASSWORD=secret")
    code = tmp_path / "hostile.py"
    code.write_text(_HOSTILE_MODEL.format(home=str(home), store=str(store)))
    mlflow.set_tracking_uri(hetflow_env["MLFLOW_TRACKING_URI"])
    experiment = mlflow.get_experiment_by_name("hostile") or mlflow.get_experiment(
        mlflow.create_experiment("hostile", artifact_location=(store / "hostile-artifacts").as_uri())
    )
    with mlflow.start_run(experiment_id=experiment.experiment_id):
        logged = mlflow.pyfunc.log_model(name="model", python_model=str(code), registered_model_name="hostile")
    version = logged.registered_model_version

    with ModelServer(f"models:/hostile/{version}", hetflow_env["MLFLOW_TRACKING_URI"], tmp_path / "s.log") as server:
        tried = server.predict(np.zeros((1, 4), np.float32))
    assert tried.tolist() == [[0.0, 0.0, 0.0]]  # wrote nothing, read no secret
    assert not (home / "planted").exists() and not (store / "planted").exists()
    hidden = [str(home), str(store), os.environ["AIRFLOW_HOME"], os.path.expanduser("~")]
    assert server.isolation == {"confined": True, "hidden": hidden}


@needs_root
def test_hiding_a_directory_that_holds_the_checkout_keeps_the_code_and_interpreter_visible():
    """A HETFLOW_HOME above the checkout (here: its parent) hides it, but not what the command runs."""
    import sys

    probe = "import tasks.confine, os; print(os.access(tasks.confine.__file__, os.W_OK))"
    command = confine.confined([sys.executable, "-c", probe], hide=[str(REPO.parent)], working_directory=str(REPO))
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"  # the code runs, read-only


@needs_root
def test_a_checkout_under_tmp_stays_visible_in_the_private_tmp(tmp_path):
    """A clone under /tmp (a CI's, say): the confined command's private /tmp must not hide the code
    it runs (the replicas of such a clone failed with "No such file or directory")."""
    import importlib.util
    import shutil

    checkout = tmp_path / "checkout"  # pytest's tmp_path lies under /tmp
    (checkout / "tasks").mkdir(parents=True)
    shutil.copy(REPO / "tasks" / "confine.py", checkout / "tasks" / "confine.py")
    (checkout / "tasks" / "code.txt").write_text("the checkout's code")
    loader = importlib.util.spec_from_file_location("confine_in_tmp", checkout / "tasks" / "confine.py")
    confine_in_tmp = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(confine_in_tmp)

    command = confine_in_tmp.confined(["cat", str(checkout / "tasks" / "code.txt")], working_directory="/")
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the checkout's code"


@needs_root
def test_directories_hidden_and_shown_inside_each_other_nest_as_written(tmp_path):
    """A checkout shown inside a hidden home, holding a hidden HETFLOW_HOME that holds the shown run
    directory: each mount goes over its parent's, none covers a deeper one."""
    user = tmp_path / "user"
    checkout, runs = user / "checkout", user / "checkout" / ".hetflow" / "runs"
    for directory in (runs / "mine", runs / "other"):
        directory.mkdir(parents=True)
    (checkout / "code.py").write_text("code")
    (user / "key").write_text("secret")
    probe = textwrap.dedent(
        f"""
        import os
        print(os.path.exists({str(user / "key")!r}), open({str(checkout / "code.py")!r}).read(),
              os.access({str(checkout)!r}, os.W_OK), sorted(os.listdir({str(runs)!r})),
              os.access({str(runs / "mine")!r}, os.W_OK))
        """
    )
    command = confine.confined(
        ["python3", "-c", probe],
        hide=[str(user), str(checkout / ".hetflow")],
        read_write=[str(runs / "mine")],
        read_only=[str(checkout)],
        working_directory="/",
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "code", "False", "['mine']", "True"]

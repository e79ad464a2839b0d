"""What a sandboxed process sees of the file system (``hetflow.sandbox``): local replicas see their run
directory (read-only, but for their output folder) and the prepared data (read-only) of
HETFLOW_HOME, nothing else of it, and change nothing outside their output folder and their own
/tmp. Real bubblewrap sandboxes (the hostile probes are in test_sandbox.py)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ATTEMPT, REPO, run_sandboxed, wait_for

from hetflow import sandbox
from hetflow.cluster.processes import run_replicas
from hetflow.paths import hetflow_home, run_paths

# Tries each write and read, and reports what happened, one line each.
_PROBE = ATTEMPT + textwrap.dedent(
    """
    import os, sys
    home, run, data = sys.argv[1:4]
    attempt("write-run", lambda: open(os.path.join(run, "written"), "w").write("x"))
    attempt("write-data", lambda: open(os.path.join(data, "written"), "w").write("x"))
    attempt("write-repo", lambda: open(sys.argv[4], "w").write("x"))
    attempt("write-root", lambda: open("/written", "w").write("x"))
    attempt("read-data", lambda: open(os.path.join(data, "shard")).read())
    attempt("read-secret", lambda: open(os.path.join(home, "stack", "compose.env")).read())
    attempt("read-other-run", lambda: os.listdir(os.path.join(home, "runs", "other")))
    attempt("write-tmp", lambda: open("/tmp/written", "w").write("x"))
    print("home", sorted(os.listdir(home)))
    print("caps", [line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff")][0])
    """
)


def test_a_sandboxed_command_sees_only_what_it_is_shown_and_changes_only_what_it_may(tmp_path):
    home = tmp_path / "home"
    run, data, other = home / "runs" / "mine", home / "data", home / "runs" / "other"
    for directory in (run, data, other, home / "stack"):
        directory.mkdir(parents=True)
    sandbox.hand_over(run)
    (data / "shard").write_text("examples")
    (home / "stack" / "compose.env").write_text("AIRFLOW_PASSWORD=secret")
    planted_in_repo = REPO / f"planted-{tmp_path.name}"
    box = sandbox.Sandbox(read_write=[str(run)], read_only=[str(data)], hidden=[str(home)])
    done = run_sandboxed(box, ["python3", "-c", _PROBE, str(home), str(run), str(data), str(planted_in_repo)])
    assert done.returncode == 0, done.stderr
    seen = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert seen["write-run"] == "ok" and (run / "written").read_text() == "x"
    assert seen["write-data"] == "OSError 30"  # EROFS
    assert seen["write-repo"] == "OSError 30" and not planted_in_repo.exists()
    assert seen["write-root"] == "OSError 30"
    assert seen["read-data"] == "ok"
    assert seen["read-secret"] == "FileNotFoundError 2"
    assert seen["read-other-run"] == "FileNotFoundError 2"
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


@pytest.mark.replicas
def test_a_local_replica_sees_its_run_directory_and_the_data_only(provisioned):
    home = hetflow_home()
    other_run = home / "runs" / "someone_elses_files"  # its own: test_sandbox.py leaves a record in someone_else
    other_run.mkdir(parents=True, exist_ok=True)
    (home / "stack").mkdir(exist_ok=True)
    (home / "stack" / "compose.env").write_text("AIRFLOW_PASSWORD=secret")

    run_id = provisioned(strategy="multi_worker_mirrored", workers=2)
    paths = run_paths(run_id)
    record = json.loads(paths.cluster.read_text())["file_isolation"]
    prepared = json.loads(paths.dataset.read_text())["prepared_dir"]  # its own dataset's version, no other data
    assert record == {
        "confined": True,
        "hidden": sandbox.private_directories(),
        "read_write": [str(paths.output)],
        "read_only": [str(paths.root), prepared],
    }
    assert str(home) in record["hidden"] and os.path.expanduser("~") in record["hidden"]
    assert wait_for(lambda: len(run_replicas(run_id)) == 2, timeout=60)
    replica = run_replicas(run_id)["worker-0"]
    # The replica's view, through its own root: HETFLOW_HOME holds the way to its run and the data.
    view = Path(f"/proc/{replica}/root")
    assert sorted(p.name for p in (view / home.relative_to("/")).iterdir()) == ["data", "runs"]
    assert [p.name for p in (view / home.relative_to("/") / "runs").iterdir()] == [paths.root.name]
    options = _mount_options(replica)
    assert options[str(paths.root)].startswith("ro") and options[str(paths.output)].startswith("rw")
    assert options[prepared].startswith("ro")
    assert options["/"].startswith("ro")
    status = Path(f"/proc/{replica}/status").read_text()
    assert "CapEff:\t0000000000000000" in status and "CapBnd:\t0000000000000000" in status
    assert not status.split("Uid:")[1].split()[0] == "0"
    # It runs: its TF server came up and the log its keeper writes grows.
    log = paths.logs / "worker-0.log"
    size = log.stat().st_size
    time.sleep(1)
    assert wait_for(lambda: log.stat().st_size > size, timeout=60)
    assert other_run.is_dir() and os.listdir(other_run) == []


def test_hiding_a_directory_that_holds_the_checkout_keeps_the_code_and_interpreter_visible():
    """A HETFLOW_HOME above the checkout (here: its parent) hides it, but not what the command runs."""
    probe = "import hetflow.sandbox, os; print(os.access(hetflow.sandbox.__file__, os.W_OK))"
    box = sandbox.Sandbox(hidden=[str(REPO.parent)], working_directory=str(REPO))
    done = run_sandboxed(box, [sys.executable, "-c", probe])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"  # the code runs, read-only


def test_a_directory_shown_under_tmp_stays_visible_in_the_private_tmp(tmp_path):
    """A clone under /tmp (a CI's, say; pytest's is under a directory only root may enter): the
    sandbox's private /tmp must not hide what it is shown there."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "code.txt").write_text("the checkout's code")
    done = run_sandboxed(sandbox.Sandbox(read_only=[str(checkout)]), ["cat", str(checkout / "code.txt")])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the checkout's code"


def test_directories_hidden_and_shown_inside_each_other_nest_as_written(tmp_path):
    """A checkout shown inside a home, holding a hidden HETFLOW_HOME that holds the shown run
    directory: each mount goes over its parent's, none covers a deeper one."""
    user = tmp_path / "user"
    checkout, runs = user / "checkout", user / "checkout" / ".hetflow" / "runs"
    for directory in (runs / "mine", runs / "other"):
        directory.mkdir(parents=True)
    sandbox.hand_over(runs / "mine")
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
    box = sandbox.Sandbox(
        read_write=[str(runs / "mine")],
        read_only=[str(checkout)],
        hidden=[str(user), str(checkout / ".hetflow")],
    )
    done = run_sandboxed(box, ["python3", "-c", probe])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "code", "False", "['mine']", "True"]


def test_a_data_dir_outside_the_allowed_roots_is_refused_in_one_line(tmp_path, monkeypatch):
    """data_dir is shown to every replica: the stack's secrets or /run (the Docker socket) must not
    be. HETFLOW_HOME/data and the roots the operator lists are allowed; a link out of one is not."""
    from hetflow.spec import SpecError, parse_spec

    monkeypatch.setenv("HETFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HETFLOW_DATA_ROOTS", raising=False)
    (tmp_path / "home" / "data").mkdir(parents=True)
    (tmp_path / "home" / "data" / "escape").symlink_to("/run")
    assert parse_spec({"data_dir": str(tmp_path / "home" / "data" / "tfds")}).data.data_dir.endswith("tfds")
    for refused in ("/run", str(tmp_path / "home" / "stack"), str(tmp_path / "home" / "data" / "escape"), "/"):
        with pytest.raises(SpecError) as caught:
            parse_spec({"data_dir": refused})
        [problem] = caught.value.problems
        assert problem.startswith(f"data_dir={refused} is invalid: expected empty or a folder under ")
        assert "HETFLOW_DATA_ROOTS" in problem and "\n" not in problem
    monkeypatch.setenv("HETFLOW_DATA_ROOTS", str(tmp_path / "datasets"))
    assert parse_spec({"data_dir": str(tmp_path / "datasets" / "tfds")}).data.data_dir.endswith("tfds")

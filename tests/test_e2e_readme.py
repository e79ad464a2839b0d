"""The README's first command as a new user runs it: `make run` in a fresh clone, with nothing of
hetflow's or MLflow's in the environment (the rest of the suite sets HETFLOW_HOME and
MLFLOW_TRACKING_URI for every test, so it never takes this path), and what the terminal and MLflow
then show.

The clone gets this checkout's uncommitted changes (what is tested is the tree as it is) and its
wheelhouse, hard-linked: `make run` sets up its own virtualenv from it, but does not download the
wheels a second time."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

MODELS = ("hetflow-digits", "hetflow-digits-tflite")  # the float model, then the TFLite one
GATE_AGAINST_CHAMPION = (
    r"test accuracy \d\.\d{4} (beats|does not beat) champion v1 \(\d\.\d{4}\) "
    r"by min_improvement [\d.]+ \(margin [+-]\d\.\d{4}\)"
)
MAKE_RUN_TIMEOUT = 2400  # the venv's install (about 2 min here) and the defaults' 40 epochs


def _clone(destination: Path) -> Path:
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(destination)], check=True)
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--modified", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, listed):
        source, target = REPO / name, destination / name
        if source.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        else:  # deleted here, not committed yet
            target.unlink(missing_ok=True)
    wheelhouse = REPO / "build" / "wheelhouse"
    if (wheelhouse / ".complete").exists():
        (destination / "build").mkdir()
        subprocess.run(["cp", "-al", str(wheelhouse), str(destination / "build" / "wheelhouse")], check=True)
    return destination


def _user_environment(home: Path) -> dict[str, str]:
    """What a new user's shell holds: no HETFLOW_*, MLFLOW_*, AIRFLOW_* or virtualenv."""
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
    }


def _run_dirs() -> set[str]:
    runs = REPO / ".hetflow" / "runs"
    return {path.name for path in runs.iterdir()} if runs.exists() else set()


class MakeRun:
    """`make run` in a clone, each run's terminal kept."""

    def __init__(self, root: Path):
        self.clone = _clone(root / "hetflow")
        self.home = root / "home"
        self.home.mkdir()
        self.checkout_runs = _run_dirs()

    def __call__(self, *make_arguments: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            ["make", "run", *make_arguments], cwd=self.clone, env=_user_environment(self.home),
            capture_output=True, text=True, timeout=MAKE_RUN_TIMEOUT,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        return done

    def client(self):
        from hetflow.registry import store

        return store.client(f"sqlite:///{self.clone / 'mlflow' / 'mlflow.db'}")


@pytest.fixture(scope="module")
def make_run(tmp_path_factory) -> MakeRun:
    return MakeRun(tmp_path_factory.mktemp("readme"))


@pytest.fixture(scope="module")
def first(make_run) -> subprocess.CompletedProcess:
    return make_run()


def registered_lines(terminal: str) -> dict[str, tuple[list[str], str]]:
    """Each registered model's aliases and gate, as the summary at the end of the terminal says."""
    found = re.findall(r"^  registered +models:/([\w-]+)/\d+ aliases=(\[.*\])\n  gate +(.+)$", terminal, re.MULTILINE)
    return {name: (json.loads(aliases.replace("'", '"')), gate) for name, aliases, gate in found}


def test_the_first_make_run_promotes_both_models_and_says_so(make_run, first):
    terminal = first.stdout
    summary = Path(terminal.strip().splitlines()[-1])
    assert summary.is_relative_to(make_run.clone / ".hetflow" / "runs") and summary.name == "summary.json"
    assert json.loads(summary.read_text())["status"] == "success"
    assert registered_lines(terminal) == {name: (["candidate", "champion"], "no champion yet") for name in MODELS}
    client = make_run.client()
    for name in MODELS:
        assert int(client.get_model_version_by_alias(name, "champion").version) == 1


def test_the_first_make_run_writes_nothing_outside_the_clone(make_run, first):
    assert (make_run.clone / "mlflow" / "mlflow.db").exists()
    for default_store in ("mlflow.db", "mlruns"):  # MLflow's own default, relative to the working directory
        assert not (make_run.clone / default_store).exists()
    assert _run_dirs() == make_run.checkout_runs
    # The home holds only what `make run`'s setup put there: pip's cache, as any pip install does.
    assert {path.relative_to(make_run.home).parts[:2] for path in make_run.home.rglob("*")} <= {
        (".cache",),
        (".cache", "pip"),
    }


def test_make_serve_then_answers_tf_serving_requests_with_each_champion_and_leaves_nothing(make_run, first):
    """The README's third command: `make serve` after `make run`, and a TF Serving client's request."""
    from hetflow.serving.server import free_port

    port = free_port()
    serve = subprocess.Popen(
        ["make", "serve", f"ARGS=--port {port}"], cwd=make_run.clone, env=_user_environment(make_run.home),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        lines = []
        for line in serve.stdout:  # until the endpoint says what it serves
            lines.append(line)
            if line.startswith("hetflow serve: "):
                break
        assert lines[-1] == (
            f"hetflow serve: http://127.0.0.1:{port}/v1/models/<name>:predict serves "
            f"{MODELS[0]} v1, {MODELS[1]} v1; Ctrl-C stops it\n"
        ), "".join(lines)[-3000:]
        for name in MODELS:  # a blank 8x8x1 image
            status, version, answer = _tf_serving_predict(port, name, [[[0]] * 8] * 8)
            assert (status, version, len(answer["predictions"][0])) == (200, "1", 10), (name, answer)
        status, _, answer = _tf_serving_predict(port, MODELS[0], [[0] * 8] * 8)  # no channel axis
        assert status == 400 and "shape" in answer["error"] and "Traceback" not in answer["error"], answer
        started = _processes_of(f"/tmp/hetflow-serve-{port}-")
        assert any("haproxy" in command for command in started.values()), started
        assert sum("serving/model_server " in command for command in started.values()) >= 2, started
    finally:
        os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C at the terminal reaches make and hetflow
        serve.wait(60)
    assert _processes_of(f"/tmp/hetflow-serve-{port}-") == {}
    assert not list(Path("/tmp").glob(f"hetflow-serve-{port}-*"))


def _tf_serving_predict(port: int, model: str, instance) -> tuple[int, str, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", f"/v1/models/{model}:predict", body=json.dumps({"instances": [instance]}))
        response = connection.getresponse()
        return response.status, response.getheader("X-Model-Version", ""), json.loads(response.read())
    finally:
        connection.close()


def _processes_of(folder: str) -> dict[int, str]:
    """Every process whose command line names the endpoint's folder (HAProxy's config, the model
    servers' copies): they run in process groups of their own, not make's."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        if folder in command:
            found[int(cmdline.parent.name)] = command
    return found


@pytest.mark.heavy
def test_a_second_make_run_compares_with_both_champions_and_says_why(make_run, first):
    # Another spec: the same one again is skipped, as trained before (skip_unchanged).
    gates = registered_lines(make_run("ARGS=--set epochs=20").stdout)
    assert set(gates) == set(MODELS)
    for name, (aliases, gate) in gates.items():
        assert "candidate" in aliases
        # The same data: the champion's recorded accuracy is compared, and the margin said.
        assert re.fullmatch(GATE_AGAINST_CHAMPION, gate), gate
        assert ("champion" in aliases) == (" beats champion" in gate)
    assert not (make_run.clone / "mlflow.db").exists()

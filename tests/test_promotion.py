"""The champion gate under concurrency and in a shared registry (issue #17, items 4 and 1; #28, item 7).

Two register tasks of concurrent DAG runs are two processes over one MLflow store: here they are
two real processes over the session's SQLite store, or over a real MLflow server from two homes
that spell its URI differently (two hosts), their steps interleaved with events at the point where
an unserialised gate goes wrong.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import Future
from pathlib import Path

import pytest
from conftest import REPO

FINGERPRINT = "f" * 16  # every version was scored on the same prepared data: recorded accuracies count


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow server over a SQL store, started as make up starts it; yields its port."""
    from devstack.processes import mlflow_server_command
    from hetflow.serving.server import free_port

    store = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    with (store / "server.log").open("w") as log:
        server = subprocess.Popen(
            mlflow_server_command(store / "mlflow.db", port),
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (store / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the MLflow server did not answer within 180 s"
                time.sleep(1)
        yield port
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def _home(tmp_path: Path, name: str, uri: str) -> dict[str, str]:
    """The environment of a host of its own: its HETFLOW_HOME, its spelling of the tracking URI."""
    (tmp_path / name).mkdir()
    return {**os.environ, "HETFLOW_HOME": str(tmp_path / name), "MLFLOW_TRACKING_URI": uri}


def _new_registered_model(name: str, champion_accuracy: float, candidates: list[float], uri=None) -> list[str]:
    """A hetflow registered model whose v1 is champion at ``champion_accuracy``, with one version per
    candidate accuracy not yet gated. Returns the candidates' versions."""
    from hetflow.registry.champion import CHAMPION
    from hetflow.registry.store import EXPERIMENT
    from hetflow.registry.versions import own_registered_model
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    own_registered_model(client, name, name)
    experiment = client.get_experiment_by_name(EXPERIMENT) or client.get_experiment(
        client.create_experiment(EXPERIMENT)
    )
    run_id = client.create_run(experiment.experiment_id).info.run_id
    versions = []
    for accuracy in [champion_accuracy, *candidates]:
        version = client.create_model_version(name, f"runs:/{run_id}/model", run_id=run_id).version
        client.set_model_version_tag(name, version, "dataset.fingerprint", FINGERPRINT)
        client.set_model_version_tag(name, version, "test_accuracy", repr(accuracy))
        versions.append(version)
    client.set_registered_model_alias(name, CHAMPION, versions[0])
    return versions[1:]


def _gate(name: str, version: str, accuracy: float, log_dir: Path, ready=None) -> None:
    """What a run's register task does with its version once registered: tag it, gate it, move
    the aliases. Its served check passed: that check serves real models in tests/test_serving.py,
    here the gate is what is under test. ``ready`` is called once the process has started up."""
    from hetflow.registry import champion
    from hetflow.spec import RunSpec
    from mlflow import MlflowClient

    served = {
        "passed": True,
        "start_seconds": 1.0,
        "agreement": 1.0,
        "examples": 8,
        "max_logit_difference": 0.0,
        "latency_p50_ms": 1.0,
        "latency_p99_ms": 1.0,
        "latency_requests": 100,
    }
    checked = Future()  # the check register runs beside the other model's
    checked.set_result(served)
    client = MlflowClient()
    registered = client.get_model_version(name, version)
    if ready:
        ready()
    champion.promote(
        client,
        RunSpec(min_improvement=0.001),
        registered,
        accuracy,
        {"fingerprint": FINGERPRINT},
        {"dataset.fingerprint": FINGERPRINT},
        checked,
        "report",
        "table",
        log_dir,  # unused: the champion's score is recorded, nothing is served
    )


def _waits_for_a_file_lock(pid: int) -> bool:
    """Whether the process is blocked in flock(): Linux lists each waiter in /proc/locks after '->'."""
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if fields[1:3] == ["->", "FLOCK"] and int(fields[5]) == pid:
            return True
    return False


def _worse_run(name, version, log_dir, pause_at, paused, better, env) -> None:
    """The 0.93 run, on the host ``env`` describes. It pauses at ``pause_at`` (``read``: right after
    its first read of ``champion``; ``set``: right before it sets ``champion``) until the 0.95 run
    is done or waits for a lock (which this run may hold)."""
    os.environ.update(env)
    from hetflow.registry import champion
    from mlflow import MlflowClient

    def pause():
        paused.set()
        deadline = time.monotonic() + 120
        while not (
            better["done"].is_set()
            or better["waits_in_registry"].is_set()
            or (better["pid"].value and _waits_for_a_file_lock(better["pid"].value))
        ):
            assert time.monotonic() < deadline, "the 0.95 run neither finished nor waited for a lock"
            time.sleep(0.05)

    if pause_at == "read":
        read = champion.version_by_alias

        def read_then_pause(client, model, alias):
            found = read(client, model, alias)
            if alias == champion.CHAMPION and not paused.is_set():
                pause()
            return found

        champion.version_by_alias = read_then_pause
    else:
        set_alias = MlflowClient.set_registered_model_alias

        def pause_then_set(client, model, alias, to_version):
            if alias == champion.CHAMPION:
                pause()
            set_alias(client, model, alias, to_version)

        MlflowClient.set_registered_model_alias = pause_then_set
    _gate(name, version, 0.93, log_dir)


def _better_run(name, version, log_dir, worse_paused, better, env) -> None:
    """The 0.95 run, on the host ``env`` describes, gating its version once the 0.93 run has paused."""
    os.environ.update(env)
    from hetflow.registry import registry_lock

    poll_pause = registry_lock._poll_pause

    def say_waiting_then_pause(seconds):
        better["waits_in_registry"].set()
        poll_pause(seconds)

    registry_lock._poll_pause = say_waiting_then_pause

    def when_worse_paused():
        assert worse_paused.wait(120), "the 0.93 run never reached the point where it pauses"
        better["pid"].value = os.getpid()

    _gate(name, version, 0.95, log_dir, ready=when_worse_paused)
    better["done"].set()


@pytest.mark.parametrize(
    "pause_at, hosts",
    [("read", "one"), ("set", "one"), ("set", "two")],
)
def test_a_worse_candidate_that_read_the_champion_first_does_not_take_it_from_a_better_one(
    hetflow_env, tmp_path, request, pause_at, hosts
):
    """0.93 has read the 0.90 champion (``read``), or has decided to replace it (``set``), when
    0.95 is promoted: 0.95 stays champion. On ``one`` host the two runs share a home and the
    session's SQLite store; on ``two`` each has its own home and spells the URI of one MLflow
    server its own way (127.0.0.1, localhost): only the lock in the registry keeps them apart."""
    from hetflow.registry.champion import CHAMPION
    from mlflow import MlflowClient

    name = f"race-{pause_at}-{hosts}"
    if hosts == "one":
        uri, env_worse, env_better = hetflow_env["MLFLOW_TRACKING_URI"], hetflow_env, hetflow_env
    else:
        port = request.getfixturevalue("mlflow_server")
        uri = f"http://127.0.0.1:{port}"
        env_worse, env_better = _home(tmp_path, "worse", uri), _home(tmp_path, "better", f"http://localhost:{port}")
    better_version, worse_version = _new_registered_model(name, 0.90, [0.95, 0.93], uri)
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter, as each Airflow task is
    worse_paused = spawn.Event()
    better = {"done": spawn.Event(), "waits_in_registry": spawn.Event(), "pid": spawn.Value("i", 0)}
    runs = [
        spawn.Process(
            target=_worse_run, args=(name, worse_version, tmp_path, pause_at, worse_paused, better, env_worse)
        ),
        spawn.Process(target=_better_run, args=(name, better_version, tmp_path, worse_paused, better, env_better)),
    ]
    try:
        for run in runs:
            run.start()
        for run in runs:
            run.join(240)
        assert [run.exitcode for run in runs] == [0, 0]
    finally:
        for run in runs:
            if run.is_alive():
                run.kill()

    client = MlflowClient(uri)
    assert client.get_model_version_by_alias(name, CHAMPION).version == better_version
    gates = {v: client.get_model_version(name, v).tags["gate"] for v in (better_version, worse_version)}
    if pause_at == "read":  # 0.93 decides after 0.95 was promoted, against it
        assert f"0.9300 does not beat champion v{better_version} (0.9500)" in gates[worse_version], gates
    else:  # 0.93 held the lock when 0.95 came: 0.95 waited and compared against the 0.93 it then found
        assert "0.9300 beats champion v1 (0.9000)" in gates[worse_version], gates
        assert f"0.9500 beats champion v{worse_version} (0.9300)" in gates[better_version], gates
    assert client.search_registered_models(f"name LIKE '{name} (%'") == []  # the lock went with its holder


def test_the_promotion_lock_is_one_per_registered_model_and_dies_with_its_holder(hetflow_env):
    """A promotion of another registered model does not wait; one of the same model does, until
    the holder releases it, also by dying (a task SIGKILLed by Airflow leaves no stale lock)."""
    from mlflow import MlflowClient

    _registered(MlflowClient(hetflow_env["MLFLOW_TRACKING_URI"]), "held", "other-model")
    holder = _lock_holder("held", hetflow_env)
    try:
        assert holder.stdout.readline() == "held\n"
        assert _acquired_within("other-model", FREE_WITHIN)
        assert not _acquired_within("held", 2)
        holder.kill()
        holder.wait(10)
        assert _acquired_within("held", FREE_WITHIN)
    finally:
        holder.kill()


def test_the_promotion_lock_holds_against_a_differently_spelled_tracking_uri(hetflow_env, tmp_path):
    """The same registry reached by two spellings of its URI (here the SQLite file through a link
    to its folder; in the compose stack http://mlflow:5000 beside http://127.0.0.1:5000 on the
    host) is one registry: one promotion at a time."""
    from mlflow import MlflowClient

    uri = hetflow_env["MLFLOW_TRACKING_URI"]
    store = Path(uri.removeprefix("sqlite:///"))
    (tmp_path / "store").symlink_to(store.parent)
    other_spelling = f"sqlite:///{tmp_path / 'store' / store.name}"
    assert other_spelling != uri
    _registered(MlflowClient(uri), "spelled")
    holder = _lock_holder("spelled", {**hetflow_env, "MLFLOW_TRACKING_URI": other_spelling})
    try:
        assert holder.stdout.readline() == "held\n"
        assert not _acquired_within("spelled", 2)
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert _acquired_within("spelled", FREE_WITHIN)
    finally:
        holder.kill()


def test_the_promotion_lock_excludes_another_host_that_spells_the_server_uri_its_own_way(mlflow_server, tmp_path):
    """Two hosts (two homes: two flocks that know nothing of each other) reach one MLflow server as
    http://127.0.0.1:PORT and http://localhost:PORT: the second waits in the registry while the
    first holds, and takes the lock once it is released. MLflow's Models page says what the lock
    is and who holds it."""
    from hetflow.registry.registry_lock import HELD_BY_TAG, lock_name
    from mlflow import MlflowClient

    client = MlflowClient(f"http://127.0.0.1:{mlflow_server}")
    _registered(client, "two-hosts")
    first = _lock_holder("two-hosts", _home(tmp_path, "first", f"http://127.0.0.1:{mlflow_server}"))
    second = None
    try:
        assert _Output(first.stdout).says_within("held", FREE_WITHIN)
        second = _lock_holder("two-hosts", _home(tmp_path, "second", f"http://localhost:{mlflow_server}"))
        said, logged = _Output(second.stdout), _Output(second.stderr)
        assert logged.says_within("waiting for two-hosts (promotion lock)", FREE_WITHIN)
        assert not said.says_within("held", 3)
        lock = client.get_registered_model(lock_name("two-hosts"))
        assert f"pid {first.pid}: " in lock.tags[HELD_BY_TAG], lock.tags
        assert lock.description.startswith("Not a model.") and "'two-hosts'" in lock.description, lock.description
        _release(first)
        assert said.says_within("held", FREE_WITHIN)
        _release(second)
        assert client.search_registered_models("name LIKE 'two-hosts (%'") == []
    finally:
        for holder in (first, second):
            if holder:
                holder.kill()


def test_a_dead_holders_lock_in_the_registry_is_taken_over_once_its_heartbeat_stops(
    mlflow_server, tmp_path, monkeypatch
):
    """A holder on another host is SIGKILLed while holding: its flock dies with it, its lock in the
    registry does not. The waiter does not take the lock while the holder lives and beats (two
    stale periods), takes it once the heartbeat has stood still for the stale period, and leaves a
    tombstone named after the dead holder's token, which a later holder sweeps once it is old."""
    from hetflow.registry import registry_lock
    from mlflow import MlflowClient

    name, uri = "dead-holder", f"http://127.0.0.1:{mlflow_server}"
    client = MlflowClient(uri)
    _registered(client, name)
    quick = {"HEARTBEAT_SECONDS": 0.5, "STALE_AFTER_SECONDS": 4, "POLL_SECONDS": 0.2}
    first = _lock_holder(name, _home(tmp_path, "first", uri), quick)
    second = None
    try:
        assert _Output(first.stdout).says_within("held", FREE_WITHIN)
        token = client.get_registered_model(registry_lock.lock_name(name)).tags[registry_lock.HOLDER_TAG]
        second = _lock_holder(name, _home(tmp_path, "second", f"http://localhost:{mlflow_server}"), quick)
        said, logged = _Output(second.stdout), _Output(second.stderr)
        assert logged.says_within(f"waiting for {name} (promotion lock)", FREE_WITHIN)
        assert not said.says_within("held", 8)
        first.kill()
        first.wait(10)
        killed = time.monotonic()
        assert said.says_within("held", FREE_WITHIN)
        assert time.monotonic() - killed > 3  # the stale period, less a heartbeat and a poll
        assert logged.says_within(f"took over {name} (promotion lock) held by ", 1)
        tombstone = client.get_registered_model(registry_lock.tombstone_name(name, token))
        assert tombstone.tags[registry_lock.HOLDER_TAG] == token
        _release(second)
        assert [found.name for found in client.search_registered_models(f"name LIKE '{name} (%'")] == [tombstone.name]
    finally:
        for holder in (first, second):
            if holder:
                holder.kill()
    monkeypatch.setattr(registry_lock, "SWEEP_AFTER_SECONDS", 0)
    later = registry_lock.RegistryLock(client, name, "a later promotion")
    later.acquire()
    later.release()
    assert client.search_registered_models(f"name LIKE '{name} (%'") == []


def test_a_waiter_that_read_a_dead_holder_late_cannot_rename_the_next_holders_lock_away(hetflow_env):
    """Two waiters saw the same dead holder. The first renames its lock to that holder's tombstone
    and takes the lock; the second, acting on what it read before, tries the same rename: the
    tombstone's name is taken, so the rename fails and the new holder keeps its lock."""
    from hetflow.registry import registry_lock
    from mlflow import MlflowClient

    name = "late-breaker"
    client = MlflowClient()
    _registered(client, name)
    dead = registry_lock.RegistryLock(client, name, "a task SIGKILLed while it held the lock")
    dead.acquire()
    dead._stop.set()  # its heartbeat dies with it; the lock stays in the registry
    first = registry_lock.RegistryLock(client, name, "the first waiter")
    late = registry_lock.RegistryLock(client, name, "the late waiter")
    assert first._break(dead.token, dead.held_by, "its heartbeat stopped")
    first.acquire()
    try:
        assert not late._break(dead.token, dead.held_by, "its heartbeat stopped (as read before)")
        first.confirm()  # still its lock
        lock = client.get_registered_model(registry_lock.lock_name(name))
        assert lock.tags[registry_lock.HOLDER_TAG] == first.token
    finally:
        first.release()
    assert (
        client.get_registered_model(registry_lock.tombstone_name(name, dead.token)).tags[registry_lock.HOLDER_TAG]
        == dead.token
    )


class _Output:
    """The lines a process writes to one of its pipes, read as they come."""

    def __init__(self, stream):
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in stream], daemon=True).start()

    def says_within(self, text: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                if text in self.lines.get(timeout=left):
                    return True
            except queue.Empty:
                return False
        return False


def _release(holder: subprocess.Popen) -> None:
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert holder.wait(30) == 0


def _registered(client, *names: str) -> None:
    for name in names:
        try:
            client.create_registered_model(name)
        except Exception:  # noqa: BLE001  (made by an earlier test of the session)
            client.get_registered_model(name)


def _acquired_within(name: str, seconds: float) -> bool:
    """Whether this process takes ``name``'s promotion lock within ``seconds``; an error taking it
    is raised here, not lost in the thread."""
    from hetflow.registry.champion import promotion_lock

    got, errors = threading.Event(), []

    def take():
        try:
            with promotion_lock(name):
                got.set()
        except Exception as error:  # noqa: BLE001  (re-raised below, in the test)
            errors.append(error)
            got.set()

    threading.Thread(target=take, daemon=True).start()
    acquired = got.wait(seconds)
    if errors:
        raise errors[0]
    return acquired


# A lock that is free is taken well within this, also on a loaded machine (the registry is asked
# for the model first); the waits that must time out are 2 s.
FREE_WITHIN = 30


def _lock_holder(name: str, env: dict[str, str], lock_settings: dict[str, float] | None = None) -> subprocess.Popen:
    """A process that takes ``name``'s promotion lock, says "held" and keeps it until a line comes;
    it logs at INFO to stderr. ``lock_settings``: values of ``registry_lock``'s timings."""
    script = "import logging\nlogging.basicConfig(level=logging.INFO)\nfrom hetflow.registry import registry_lock\n"
    script += "".join(f"registry_lock.{setting} = {value!r}\n" for setting, value in (lock_settings or {}).items())
    script += f"from hetflow.registry.champion import promotion_lock\nwith promotion_lock({name!r}):\n"
    script += "    print('held', flush=True)\n    input()"
    return subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _write_run_records(paths, chosen_tflite: str | None) -> None:
    """What the stages before register leave, as far as register reads before it touches MLflow."""
    paths.root.mkdir(parents=True, exist_ok=True)
    for path in (paths.training, paths.evaluation, paths.compression):
        path.write_text("{}")
    paths.export.write_text(json.dumps({"chosen_tflite": chosen_tflite}))


@pytest.mark.parametrize("foreign", ["float", "tflite"])
def test_register_refuses_a_registered_model_hetflow_did_not_create(hetflow_env, tmp_path, foreign):
    """Someone else's model of that name (the float model's, or its ``-tflite`` twin's) is refused
    with one line naming ``registered_model``, before the run writes anything to MLflow."""
    from hetflow.paths import RunPaths
    from hetflow.registry.store import EXPERIMENT
    from hetflow.registry.versions import ForeignRegisteredModel
    from hetflow.spec import RunSpec
    from hetflow.tasks.register import register_model
    from mlflow import MlflowClient

    name = f"shared-{foreign}"
    taken = name if foreign == "float" else f"{name}-tflite"
    client = MlflowClient()
    client.create_registered_model(taken, tags={"team": "someone else"})
    paths = RunPaths(tmp_path / "run")
    _write_run_records(paths, chosen_tflite="int8")

    with pytest.raises(ForeignRegisteredModel) as refused:
        register_model(RunSpec(registered_model=name), paths, {"fingerprint": FINGERPRINT}, "hetflow_train", name)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"registered_model '{name}': "), message
    assert f"registered model '{taken}' in " in message, message
    assert client.search_model_versions(f"name='{taken}'") == []
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], f"tags.`airflow.run_id` = '{name}'") if experiment else []
    assert runs == []


def test_a_registered_model_hetflow_created_is_marked_and_taken_again(hetflow_env):
    from hetflow.registry.versions import OWNER, OWNER_TAG, own_registered_model
    from mlflow import MlflowClient

    client = MlflowClient()
    own_registered_model(client, "ours", "ours")
    assert client.get_registered_model("ours").tags == {OWNER_TAG: OWNER}
    own_registered_model(client, "ours", "ours")  # the next run registers into it: no error
    assert client.get_registered_model("ours").tags == {OWNER_TAG: OWNER}

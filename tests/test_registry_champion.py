"""The champion gate (hetflow/registry/champion.py) under concurrency and in a shared registry, and
register's refusal of a registered model hetflow did not create (hetflow/registry/versions.py).

Two register tasks of concurrent DAG runs are two processes over one MLflow store: here they are
two real processes over the session's SQLite store, or over a real MLflow server from two homes
that spell its URI differently (two hosts), their steps interleaved with events at the point where
an unserialised gate goes wrong.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from mlflow_hosts import _home

from hetflow.records import CompressionRecord, DatasetRecord, EvaluationRecord, ExportRecord

FINGERPRINT = "f" * 16  # every version was scored on the same prepared data: recorded accuracies count
DIGITS = DatasetRecord.model_construct(
    fingerprint=FINGERPRINT, name="uci_digits", input_shape=[8, 8, 1], num_classes=10
)


def _new_registered_model(name: str, champion_accuracy: float, candidates: list[float], uri=None) -> list[str]:
    """A hetflow registered model whose v1 is champion at ``champion_accuracy``, with one version per
    candidate accuracy not yet gated. Returns the candidates' versions."""
    from hetflow.registry.champion import CHAMPION
    from hetflow.registry.store import ensure_experiment
    from hetflow.registry.versions import own_registered_model
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    own_registered_model(client, name, name)
    # As the pipeline makes it: a SQLite store's artifacts beside it (MLflow's default is ./mlruns).
    run_id = client.create_run(ensure_experiment(client)).info.run_id
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
    the aliases. Its served check passed: that check serves real models in tests/test_serving_server.py,
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
        RunSpec.from_values({"min_improvement": 0.001}),
        registered,
        accuracy,
        DIGITS,
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


def _write_run_records(paths, chosen_tflite: str | None) -> None:
    """What the stages before register leave, as far as register reads before it touches MLflow."""
    paths.output.mkdir(parents=True, exist_ok=True)
    paths.training.write_text("{}")
    EvaluationRecord(test_loss=0.3, test_accuracy=0.9, test_examples=10, confusion_matrix=[[9, 1], [0, 0]]).write(paths)
    CompressionRecord(prune=False, quantize="none", variants={}).write(paths)
    ExportRecord(float_test_accuracy=0.9, artifacts={}, chosen_tflite=chosen_tflite).write(paths)


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
        register_model(
            RunSpec.from_values({"registered_model": name}),
            paths,
            DatasetRecord.model_construct(fingerprint=FINGERPRINT),
            "hetflow_train",
            name,
        )
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


def _champion_whose_server_fails(name: str, tmp_path: Path) -> str:
    """A hetflow registered model whose champion, trained on other data, is a pyfunc model whose
    loader raises when a server loads it: no server of it ever becomes healthy. Returns a candidate."""
    from hetflow.registry.champion import CHAMPION
    from hetflow.registry.versions import own_registered_model
    from mlflow import MlflowClient

    model = tmp_path / "broken-champion"
    (model / "code").mkdir(parents=True)
    (model / "MLmodel").write_text(
        "flavors:\n  python_function:\n    loader_module: never_serves\n    code: code\n    python_version: '3.11'\n"
    )
    (model / "code" / "never_serves.py").write_text("raise RuntimeError('this champion never serves')\n")
    client = MlflowClient()
    own_registered_model(client, name, name)
    # Its artifacts under the test's directory, not MLflow's default ./mlruns in the working directory.
    experiment = client.create_experiment(name, artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    client.log_artifacts(run_id, str(model), "model")
    versions = [client.create_model_version(name, f"runs:/{run_id}/model", run_id=run_id).version for _ in "ab"]
    client.set_model_version_tag(name, versions[0], "dataset.fingerprint", "other data")
    client.set_model_version_tag(name, versions[0], "test_accuracy", "0.5")
    client.set_registered_model_alias(name, CHAMPION, versions[0])
    return versions[1]


def test_a_champion_that_cannot_be_served_leaves_the_gate_undecided_not_won(hetflow_env, tmp_path):
    """The champion was trained on other data, so the gate must serve it to score it here, and its
    server never starts: the candidate is not promoted, the gate says in one line why, and a retry
    of the task decides again instead of taking that as the decision."""
    from hetflow.data.prepare import prepare_dataset
    from hetflow.registry import champion
    from hetflow.spec import RunSpec
    from mlflow import MlflowClient

    name = "unservable-champion"
    candidate = _champion_whose_server_fails(name, tmp_path)
    dataset = prepare_dataset("uci_digits", tmp_path / "data")
    client = MlflowClient()
    checked = Future()
    checked.set_result({"passed": True, "start_seconds": 1.0, "agreement": 1.0, "examples": 8,
                        "max_logit_difference": 0.0, "latency_p50_ms": 1.0, "latency_p99_ms": 1.0,
                        "latency_requests": 100})  # fmt: skip
    version = client.get_model_version(name, candidate)
    spec = RunSpec.from_values({"min_improvement": 0.0})
    model = champion.promote(client, spec, version, 0.99, dataset, {}, checked, "report", "table", tmp_path)

    assert not model["promoted"] and model["aliases"] == ["candidate"], model
    assert str(client.get_model_version_by_alias(name, champion.CHAMPION).version) == "1"
    gate = model["gate"]
    assert gate.startswith(f"undecided: champion v1 could not be served to score it on this test split, "
                           f"so version {candidate} stays candidate: server exited with code"), gate  # fmt: skip
    assert "this champion never serves" in gate and "\n" not in gate
    assert client.get_model_version(name, candidate).tags["gate"] == gate
    assert "- gate: undecided: champion v1 could not be served" in client.get_model_version(name, candidate).description
    assert champion._decided(client, version) is None  # a retry serves the champion again


def test_a_champion_of_another_task_is_not_compared_and_the_gate_says_so_in_one_line(hetflow_env, tmp_path):
    """Two image folders registered under one name: the champion was trained on 64x64 colour images
    of another folder. Scoring it on this test split would serve it for minutes and compare two tasks."""
    from hetflow.registry import champion
    from hetflow.spec import RunSpec
    from mlflow import MlflowClient

    name = "two-folders"
    [candidate] = _new_registered_model(name, 0.5, [0.99])
    client = MlflowClient()
    for key, value in {
        "dataset.name": "folder:/data/cats",
        "dataset.input_shape": "64x64x3",
        "dataset.classes": "10",
    }.items():
        client.set_model_version_tag(name, "1", key, value)
    checked = Future()
    checked.set_result({"passed": True, "start_seconds": 1.0, "agreement": 1.0, "examples": 8,
                        "max_logit_difference": 0.0, "latency_p50_ms": 1.0, "latency_p99_ms": 1.0,
                        "latency_requests": 100})  # fmt: skip
    other_data = DIGITS.model_copy(update={"fingerprint": "other"})  # not the champion's: it would be served
    version = client.get_model_version(name, candidate)
    model = champion.promote(
        client, RunSpec.from_values({"min_improvement": 0.0}), version, 0.99, other_data, {}, checked, "report", "t",
        tmp_path,
    )  # fmt: skip

    assert not model["promoted"] and model["aliases"] == ["candidate"]
    assert model["gate"] == (
        "not compared: champion v1 was trained for another task, dataset folder:/data/cats (this run: uci_digits), "
        f"input shape 64x64x3 (this run: 8x8x1); version {candidate} stays candidate (give this data a "
        "registered_model of its own)"
    )
    assert str(client.get_model_version_by_alias(name, champion.CHAMPION).version) == "1"
    assert not list(tmp_path.glob("*champion.log"))  # the champion was not served
    assert champion._decided(client, version) == model["gate"]  # a decision: a retry does not serve it either
    description = client.get_model_version(name, candidate).description
    assert description.splitlines()[0] == "Test accuracy 0.9900: stays candidate. Served check passed."

"""The one supervision of every backend: the policy as data (``decide``), the loop that carries it
out (``Supervisor``) and what it records about a restart."""

from __future__ import annotations

import json
import logging

import pytest

from hetflow.cluster.backends.docker import backend as dk
from hetflow.cluster.layout import plan_cluster
from hetflow.cluster.supervisor import (
    ReplicaFailed,
    ReplicaState,
    Supervisor,
    decide,
    exit_description,
    last_error_line,
    restartable,
)
from hetflow.pipeline.progress import StoppedEarly
from hetflow.spec import parse_spec

PS = parse_spec({"strategy": "parameter_server", "workers": 2, "ps": 1})
SYNC = parse_spec({"strategy": "multi_worker_mirrored", "workers": 2})
STAGES = parse_spec({"strategy": "model_parallel", "workers": 2})


def _layout(spec):
    ports = iter(range(46000, 46010))
    return plan_cluster(spec, "supervised-run", pick_port=lambda: next(ports))


def _states(layout, **codes) -> dict[str, ReplicaState]:
    """Every replica running, except those given as name_index=exit_code (or a ReplicaState)."""
    given = {name.replace("_", "-"): value for name, value in codes.items()}
    states = {}
    for replica in layout.replicas:
        value = given.get(replica.name)
        states[replica.name] = value if isinstance(value, ReplicaState) else ReplicaState(value)
    return states


def test_restart_policies():
    assert restartable("on_failure", 1) and restartable("on_failure", -9)
    assert restartable("exit_code", -9) and restartable("exit_code", 137)
    assert not restartable("exit_code", 1) and not restartable("never", -9)


def test_ps_and_serving_workers_are_stopped_when_the_chief_finishes():
    layout = _layout(PS)
    assert decide(layout, _states(layout), "never", 0, 0).outcome == "running"
    done = decide(layout, _states(layout, chief_0=0), "never", 0, 0)
    assert (done.outcome, done.replicas) == ("succeeded", ("worker-0", "worker-1", "ps-0"))


def test_sync_workers_all_exiting_zero_is_success_and_one_failing_fails_the_run():
    layout = _layout(SYNC)
    assert decide(layout, _states(layout, worker_0=0), "never", 0, 0).outcome == "running"
    assert decide(layout, _states(layout, worker_0=0, worker_1=0), "never", 0, 0).replicas == ()
    failed = decide(layout, _states(layout, worker_1=137), "never", 0, 0)
    assert (failed.outcome, failed.cause, failed.replicas) == ("failed", "worker-1", ("worker-0", "worker-1"))


def test_restarts_whom_and_up_to_the_backoff_limit():
    layout = _layout(PS)
    # an async worker alone; a ps (or a sync worker, or the chief) with the whole group
    alone = decide(layout, _states(layout, worker_1=-9), "on_failure", 2, 0)
    assert (alone.outcome, alone.replicas, alone.cause) == ("restart", ("worker-1",), "worker-1")
    group = decide(layout, _states(layout, ps_0=137), "on_failure", 2, 1)
    assert (group.outcome, group.replicas) == ("restart", ("chief-0", "worker-0", "worker-1", "ps-0"))
    assert decide(layout, _states(layout, ps_0=137), "on_failure", 2, 2).outcome == "failed"  # limit reached
    assert decide(layout, _states(layout, ps_0=1), "exit_code", 2, 0).outcome == "failed"  # an error, not a kill
    assert decide(layout, _states(layout, ps_0=137), "exit_code", 2, 0).outcome == "restart"
    # a server exiting by itself, even with 0, is not done: it serves until stopped
    assert decide(layout, _states(layout, worker_1=0), "never", 2, 0).cause == "worker-1"
    sync = _layout(SYNC)
    assert decide(sync, _states(sync, worker_0=-9), "on_failure", 1, 0).replicas == ("worker-0", "worker-1")
    # the killed worker took its peer down with an error: the killed one is the cause
    assert decide(sync, _states(sync, worker_0=1, worker_1=137), "on_failure", 1, 0).cause == "worker-1"
    assert decide(sync, _states(sync, worker_0=1, worker_1=2), "never", 1, 0).cause == "worker-0"
    # a model_parallel stage held its layers' variables: the chief restarts with every stage
    stages = _layout(STAGES)
    assert [replica.name for replica in stages.replicas] == ["chief-0", "worker-0", "worker-1"]
    lost = decide(stages, _states(stages, worker_1=-9), "on_failure", 1, 0)
    assert (lost.outcome, lost.replicas, lost.cause) == ("restart", ("chief-0", "worker-0", "worker-1"), "worker-1")
    assert decide(stages, _states(stages, chief_0=0), "never", 1, 0).replicas == ("worker-0", "worker-1")


def test_where_the_engine_restarts_in_place_the_supervisor_only_counts():
    layout = _layout(PS)
    restarting = ReplicaState(1, restarts=1)
    assert decide(layout, _states(layout, ps_0=restarting), "on_failure", 2, 0, True).outcome == "running"
    gave_up = ReplicaState(1, restarts=2)
    assert decide(layout, _states(layout, ps_0=gave_up), "on_failure", 2, 0, True).cause == "ps-0"
    stuck = ReplicaState(stuck="ErrImagePull: not found")
    assert decide(layout, _states(layout, worker_0=stuck), "on_failure", 2, 0, True).outcome == "failed"


def test_exit_descriptions_and_the_line_that_says_why():
    assert exit_description(-9) == "killed by SIGKILL"
    assert exit_description(137) == "killed by SIGKILL"  # a container engine's 128+N
    assert exit_description(143) == "killed by SIGTERM"
    assert exit_description(1) == "exited with code 1"
    banner = "E0000 00:00:1795431687.469595   20362 cuda_platform.cc:52] failed call to cuInit: CUDA error"
    assert last_error_line([banner, "Epoch 3/15", "I0000 00:00:17 grpc_server_lib.cc:470] Started server"]) == (
        "Epoch 3/15"
    )
    traceback = [
        "Traceback (most recent call last):",
        '  File "x.py"',
        "ValueError: loss is nan",
        "Exception ignored in: <function AtomicFunction.__del__ at 0x7f>",
        banner,
    ]
    assert last_error_line(traceback) == "ValueError: loss is nan"
    assert last_error_line([banner]) == "(no output)"


class ScriptedReplicas:
    """A backend whose replicas' states follow a script, one entry per poll (the last repeats);
    it records what the supervisor asked of it."""

    restarts_in_place = False

    def __init__(self, layout, script, output=None):
        self.layout, self.script, self.output = layout, list(script), output or {}
        self.calls: list[tuple] = []

    def attach(self):
        pass

    def detach(self):
        pass

    def poll(self):
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]

    def start(self, replicas):
        self.calls.append(("start", tuple(r.name for r in replicas)))

    def stop(self, names):
        self.calls.append(("stop", tuple(names)))

    def lines(self, name, since):
        yield from self.output.get(name, [])


def test_supervisor_stops_servers_on_success_and_names_the_failed_replica_with_its_output(tmp_path):
    layout = _layout(PS)
    done = ScriptedReplicas(layout, [_states(layout), _states(layout, chief_0=0)])
    assert Supervisor(layout, "never", 0, done, tmp_path).wait(timeout=60, interval=0) == {"chief-0": 0}
    assert done.calls == [("stop", ("worker-0", "worker-1", "ps-0"))]

    failing = ScriptedReplicas(layout, [_states(layout, ps_0=137)], {"ps-0": ["serving", "OOM"]})
    supervisor = Supervisor(layout, "never", 0, failing, tmp_path)
    supervisor.follow(["ps-0"])
    with pytest.raises(ReplicaFailed, match=r"^replica ps-0 killed by SIGKILL; last output: serving \| OOM$"):
        supervisor.wait(timeout=60, interval=0)
    stuck = ScriptedReplicas(layout, [_states(layout, worker_0=ReplicaState(stuck="ErrImagePull: not found"))])
    with pytest.raises(ReplicaFailed, match=r"^replica worker-0 could not start: ErrImagePull: not found$"):
        Supervisor(layout, "never", 0, stuck, tmp_path).wait(timeout=60, interval=0)
    hung = ScriptedReplicas(layout, [_states(layout)])
    with pytest.raises(
        ReplicaFailed, match=r"timed out after 0 s \(train_timeout_seconds\); stopped chief-0, worker-0"
    ):
        Supervisor(layout, "never", 0, hung, tmp_path).wait(timeout=0, interval=0)
    assert hung.calls == [("stop", ("chief-0", "worker-0", "worker-1", "ps-0"))]


def test_a_restart_is_carried_out_and_recorded_with_its_cause(tmp_path):
    layout = dk.plan(parse_spec({"backend": "docker", "strategy": "multi_worker_mirrored", "workers": 2}), "r")
    output = {"worker-1": ["Epoch 3/15", "E0000 00:00:17 cuda_platform.cc:52] failed call to cuInit: CUDA error"]}
    script = [_states(layout, worker_1=137), _states(layout), _states(layout, worker_0=0, worker_1=0)]
    replicas = ScriptedReplicas(layout, script, output)
    supervisor = Supervisor(layout, "on_failure", 3, replicas, tmp_path)
    supervisor.follow(["worker-1"])
    assert supervisor.wait(timeout=60, interval=0) == {"worker-0": 0, "worker-1": 0}
    everyone = ("worker-0", "worker-1")
    assert replicas.calls == [("stop", everyone), ("start", everyone), ("stop", ())]
    [restart] = json.loads((tmp_path / "replicas" / "restarts.json").read_text())
    assert restart["replica"] == "worker-1" and restart["exit_code"] == 137
    assert restart["cause"] == "killed by SIGKILL; last error: Epoch 3/15"
    assert restart["action"] == "restarted every replica"
    # a supervisor attached later (an Airflow retry) goes on counting from the record
    assert len(Supervisor(layout, "on_failure", 3, replicas, tmp_path).restarts) == 1


def test_where_the_engine_reports_a_lost_machine_late_its_replica_not_the_erroring_peer_is_the_cause(tmp_path):
    """A swarm node killed: its worker's peer exits with an error at once, the node is reported down
    seconds later; the supervisor waits loss_report_seconds and blames the lost replica."""
    layout = _layout(SYNC)
    lost = ReplicaState(-9, note="its node node-2 went down")
    script = [_states(layout, worker_0=1), _states(layout, worker_0=1), _states(layout, worker_0=1, worker_1=lost)]
    with pytest.raises(ReplicaFailed, match=r"^replica worker-1 killed by SIGKILL \(its node node-2 went down\)"):
        Supervisor(layout, "never", 0, ScriptedReplicas(layout, script), tmp_path, 5.0).wait(timeout=60, interval=0)
    # Without the wait (every other backend sees a loss at once) the erroring peer is what it has.
    script = [_states(layout, worker_0=1), _states(layout, worker_0=1, worker_1=lost)]
    with pytest.raises(ReplicaFailed, match=r"^replica worker-0 exited with code 1"):
        Supervisor(layout, "never", 0, ScriptedReplicas(layout, script), tmp_path).wait(timeout=60, interval=0)


def test_the_task_log_shows_one_line_per_epoch_the_chiefs_and_no_gpu_noise(tmp_path, caplog):
    layout = _layout(SYNC)
    epoch = "Epoch 1/2 - 0.4s (validation 0.1s) - loss: 0.9 - accuracy: 0.7 - val_loss: 0.8 - val_accuracy: 0.75"
    cuinit = "E0000 00:00:17 cuda_platform.cc:52] failed call to cuInit: CUDA error"
    output = {"worker-0": [cuinit, epoch + " - examples/s worker-0 900, worker-1 450"], "worker-1": [cuinit, epoch]}
    script = [_states(layout, worker_0=0, worker_1=0)]
    supervisor = Supervisor(layout, "never", 0, ScriptedReplicas(layout, script, output), tmp_path)
    with caplog.at_level(logging.INFO, logger="hetflow.cluster"):
        supervisor.follow(["worker-0", "worker-1"])
        supervisor.wait(timeout=60, interval=0)
    shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO and r.getMessage().startswith("[")]
    assert shown == [f"[worker-0] {epoch} - examples/s worker-0 900, worker-1 450"]
    assert list(supervisor.tails["worker-1"]) == [cuinit, epoch]  # kept for a failure's message


def test_a_watcher_asking_to_stop_stops_every_replica(tmp_path):
    layout = _layout(SYNC)
    replicas = ScriptedReplicas(layout, [_states(layout)])
    with pytest.raises(StoppedEarly, match="^training stopped early: pruned at 12 s$"):
        Supervisor(layout, "never", 0, replicas, tmp_path).wait(
            timeout=60, interval=0, should_stop=lambda: "pruned at 12 s"
        )
    assert replicas.calls == [("stop", ("worker-0", "worker-1"))]

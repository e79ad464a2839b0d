"""bench/chaos_swarm.py's verdicts on what a lost-node scenario saw, hand-made: each check holds on a
scenario that went as docs/backends.md promises and fails when its one thing went otherwise; and
bench/chaos.py's table counts what the swarm kept of a run as replicas and networks left."""

from __future__ import annotations

import copy
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))  # the bench scripts import each other as top-level modules
import chaos  # noqa: E402
import chaos_swarm  # noqa: E402

NOTHING = {"services": [], "networks": [], "node-1 containers": [], "node-1 networks": []}
VERSION = {"run_id": "mlflow-1", "source": "models:/m-1", "status": "READY"}


def went_as_promised() -> dict:
    error = "replica worker-1 killed by SIGKILL (its node node-2 went down); last output: Epoch 3/10"
    return {
        "earlier_summary": {"status": "success"},
        "earlier_nodes": {"worker-0": "node-1", "worker-1": "node-2"},
        "victim": "worker-1",
        "lost_after_seconds": 61.0,
        "lost": {"returned": {"validate_spec": {}, "train": None}, "errors": {"train": error}},
        "lost_summary": {"status": "failed", "failed_stage": "train"},
        "left_node_down": {"left": NOTHING, "after_seconds": 0.0},
        "rejoined_after_seconds": 12.0,
        "left_node_back": {"left": {"node-2 containers": [], "node-2 networks": []}, "after_seconds": 3.0},
        "earlier_files_before": {"summary.json": "a1", "training.json": "b2"},
        "earlier_files_after_loss": {"summary.json": "a1", "training.json": "b2"},
        "earlier_files_after_rerun": {"summary.json": "a1", "training.json": "b2"},
        "registry_before": {"m/1": VERSION},
        "registry_after_loss": {"m/1": VERSION},
        "registry_after_rerun": {"m/1": VERSION, "m/2": {**VERSION, "run_id": "mlflow-2"}},
        "rerun": {"returned": {}, "errors": {}},
        "rerun_summary": {"status": "success"},
        "rerun_nodes": {"worker-0": "node-1", "worker-1": "node-2"},
        "swarm_left": [],
    }


def test_every_check_holds_when_the_run_fails_naming_the_node_and_nothing_is_left_or_lost():
    checks = chaos_swarm.node_lost_checks(went_as_promised())
    assert len(checks) == 10 and all(checks.values()), checks


BROKEN = {
    "the earlier run completed": ("earlier_summary", {"status": "failed"}),
    "the run failed in train": (
        "lost",
        {"returned": {"train": None}, "errors": {"train": "replica worker-1 exited 1"}},
    ),
    "one line naming": (
        "lost",
        {
            "returned": {"train": None},
            "errors": {"train": "replica failed:\nreplica worker-1 killed by SIGKILL (its node node-2 went down)"},
        },
    ),
    "nothing of the run left on the manager": ("left_node_down", {"left": {**NOTHING, "services": ["s"]}}),
    "on the surviving node": ("left_node_down", {"left": {**NOTHING, "node-1 containers": ["c"]}}),
    "on node-2 once it is back": ("left_node_back", {"left": {"node-2 containers": ["hetflow-x-worker-1.1.y"]}}),
    "node-2 never back": ("rejoined_after_seconds", None),
    "the earlier run's directory unchanged": ("earlier_files_after_loss", {"summary.json": "a1"}),
    "the registry unchanged by the lost run": ("registry_after_loss", {"m/1": VERSION, "m/2": VERSION}),
    "the re-run after node-2 came back completed": ("rerun_summary", {"status": "failed"}),
    "the re-run on one node only": ("rerun_nodes", {"worker-0": "node-1", "worker-1": "node-1"}),
    "the earlier version changed by the re-run": (
        "registry_after_rerun",
        {"m/1": {**VERSION, "status": "FAILED"}, "m/2": {**VERSION, "run_id": "mlflow-2"}},
    ),
    "swarm.sh down left something": ("swarm_left", ["hetflow-swarm-bench-node-2"]),
}


@pytest.mark.parametrize("what", BROKEN)
def test_a_check_fails_when_its_one_thing_went_otherwise(what):
    key, value = BROKEN[what]
    seen = copy.deepcopy(went_as_promised())
    seen[key] = value
    held = chaos_swarm.node_lost_checks(seen)
    assert sum(not h for h in held.values()) == 1, held


def test_the_table_counts_what_the_swarm_kept_of_a_run_as_replicas_and_networks_left():
    result = {
        "faults": ["docker kill of node-2, running worker-1, at 61 s"],
        "runs": [{"run_id": "r", "expected": "fail", "completed": False}],
        "left": {"r": {"processes": [], "containers": [], "networks": []}},
        "records": {"r": []},
        "checks": chaos_swarm.node_lost_checks(went_as_promised()),
        "left_on_swarm": {
            "r": {"services": ["hetflow-r-worker-0"], "networks": ["hetflow-r"], "node-2 containers": ["a", "b"]}
        },
    }
    figures = chaos.scenario_figures(result)
    assert (figures["faults"], figures["replicas_left"], figures["other_leftovers"]) == (1, 3, 1)
    assert (figures["checks_held"], figures["checks"]) == (10, 10)
    record = {
        "date": "d",
        "command": "c",
        "scenarios": {"swarm_node_lost": {**result, "seen": went_as_promised()}},
        "sweep": {"swept": {}, "left_after_sweep": {}},
    }
    written = chaos.markdown(record)
    assert "| swarm_node_lost | 1 | - | - | 3 | 1 | 0 | 10 / 10 |" in written
    assert "- the train task's error: `replica worker-1 killed by SIGKILL (its node node-2 went down); " in written

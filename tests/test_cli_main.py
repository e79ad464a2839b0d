"""The hetflow command (hetflow/cli/main.py): interrupted, `hetflow run` tears down the runs whose
``provisioned_by.json`` names its own process, and no other process's."""

from __future__ import annotations

import json
import os

import psutil
import pytest

from hetflow.paths import run_paths


def _start_ticks(pid: int) -> int:
    """The clock ticks from boot to the process's start, by psutil's clock (seconds since the epoch)."""
    return round((psutil.Process(pid).create_time() - psutil.boot_time()) * os.sysconf("SC_CLK_TCK"))


@pytest.mark.replicas  # two runs provisioned, one replica each
def test_interrupted_the_command_tears_down_the_runs_this_process_provisioned_only(provisioned):
    from hetflow.cli.main import tear_down_runs_provisioned_here
    from hetflow.cluster.processes import run_processes

    ours, others = provisioned(), provisioned()
    record = json.loads(run_paths(ours).provisioned_by.read_text())
    assert record["pid"] == os.getpid() and abs(record["start_time"] - _start_ticks(os.getpid())) <= 1
    # The other run as another process (this test's parent, alive) provisioned it: its record names that one.
    parent = {"pid": os.getppid(), "start_time": _start_ticks(os.getppid())}
    run_paths(others).provisioned_by.write_text(json.dumps({**record, **parent}))
    assert run_processes(ours) and run_processes(others)

    torn_down = tear_down_runs_provisioned_here()  # earlier tests' runs in this session's home count too
    assert ours in torn_down and others not in torn_down
    assert run_processes(ours) == []
    assert run_processes(others), "the run another process provisioned was torn down"

"""The fast tier starts no replica. A test whose process starts one (a local replica's keeper or a
replica process) says so with ``@pytest.mark.replicas`` or ``@pytest.mark.slow``; ``make test-fast``
leaves both out. The guard runs in every tier, so an unmarked test that starts replicas fails
wherever it runs, naming itself. Replicas started by a child process (``hetflow train`` run as a
command) are outside its view."""

from __future__ import annotations

import subprocess

import pytest

REPLICA_MODULES = ("hetflow.cluster.backends.local.keeper", "hetflow.replica")


def starts_replicas(args) -> bool:
    """Whether a command line (as ``subprocess`` takes it) starts replicas."""
    argv = [str(arg) for arg in args] if isinstance(args, (list, tuple)) else str(args).split()
    return any(module in argv for module in REPLICA_MODULES)


@pytest.fixture(autouse=True)
def replicas_only_where_marked(request, monkeypatch):
    if request.node.get_closest_marker("replicas") or request.node.get_closest_marker("slow"):
        yield
        return
    execute_child = subprocess.Popen._execute_child

    def refuse_replicas(popen, args, *rest, **keywords):
        if starts_replicas(args):
            shown = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
            raise AssertionError(
                f"{request.node.nodeid} starts replicas ({shown[:160]}): mark it @pytest.mark.replicas"
            )
        return execute_child(popen, args, *rest, **keywords)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse_replicas)
    yield

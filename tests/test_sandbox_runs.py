"""One run's sandbox against another's (``hetflow.sandbox.run_owner``): each run's replicas, their
network holder and their run folder belong to a uid of the run's own, so that a replica of one run,
even shown another run's folder or escaped from its namespaces with its credentials, cannot signal,
trace, enter or write anything of another run, and no host process running as ``nobody`` owns a run
folder. Real runs, real replicas; the attacks are processes with run A's uid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ATTEMPT, run_sandboxed, wait_for

from hetflow import sandbox
from hetflow.cluster.backends.local import netns
from hetflow.cluster.processes import run_replicas
from hetflow.paths import run_paths

# What a process holding run A's uid tries against run B, one line per attempt.
_ESCAPED = ATTEMPT + textwrap.dedent(
    """
    import ctypes, json, os, sys
    target = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    def ptrace_attach(pid):
        if libc.ptrace(16, pid, 0, 0) != 0:  # PTRACE_ATTACH
            raise OSError(ctypes.get_errno(), "ptrace")
        libc.ptrace(17, pid, 0, 0)  # PTRACE_DETACH: the replica goes on
    attempt("signal-replica", lambda: os.kill(target["replica"], 0))
    attempt("trace-replica", lambda: ptrace_attach(target["replica"]))
    attempt("enter-network", lambda: os.open(f"/proc/{target['holder']}/ns/user", os.O_RDONLY))
    attempt("write-run", lambda: open(os.path.join(target["run"], "planted.json"), "w").write("{}"))
    """
)


def _uid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("Uid:")[1].split()[0])


@pytest.mark.replicas
@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="the attacks run the system's Python")
def test_a_replica_of_one_run_cannot_signal_trace_enter_or_write_another_run(provisioned):
    run_a, run_b = provisioned(strategy="one_device"), provisioned(strategy="one_device")
    paths_a, paths_b = run_paths(run_a), run_paths(run_b)
    assert wait_for(lambda: run_replicas(run_a) and run_replicas(run_b), timeout=60)
    replica_a, replica_b = run_replicas(run_a)["worker-0"], run_replicas(run_b)["worker-0"]
    uid_a, uid_b = _uid(replica_a), _uid(replica_b)
    assert (uid_a, uid_b) == (sandbox.run_owner(paths_a.root)[0], sandbox.run_owner(paths_b.root)[0])
    assert uid_a != uid_b and sandbox.SANDBOX_UID not in (uid_a, uid_b)
    for paths, uid in ((paths_a, uid_a), (paths_b, uid_b)):  # what a run's replicas write is their uid's
        assert (paths.output.stat().st_uid, paths.output.stat().st_gid) == (uid, uid)
        assert (paths.checkpoints.stat().st_uid, paths.checkpoints.stat().st_gid) == (uid, uid)
        assert paths.root.stat().st_uid == os.geteuid()  # the rest the pipeline's
    holder_b = json.loads(netns.record_path(paths_b.root).read_text())["pid"]
    assert _uid(holder_b) == uid_b

    # Inside run A's sandbox, shown run B's output folder (as if a view let it through): it cannot write there.
    box = sandbox.Sandbox(read_write=[str(paths_b.output)], owner=sandbox.run_owner(paths_a.root))
    planted = paths_b.output / "planted.json"
    probe = ATTEMPT + f"attempt('write-run', lambda: open({str(planted)!r}, 'w').write('{{}}'))"
    done = run_sandboxed(box, [sys.executable, "-c", probe])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "write-run PermissionError 13"

    # Escaped from its namespaces with run A's credentials (no capability, no group): still nothing of B.
    as_a = ["setpriv", f"--reuid={uid_a}", f"--regid={uid_a}", "--clear-groups", "--inh-caps=-all", "--"]
    target = {"replica": replica_b, "holder": holder_b, "run": str(paths_b.output)}
    done = subprocess.run(
        [*as_a, "/usr/bin/python3", "-c", _ESCAPED, json.dumps(target)],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    seen = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert seen == {
        "signal-replica": "PermissionError 1",
        "trace-replica": "PermissionError 1",
        "enter-network": "PermissionError 13",
        "write-run": "PermissionError 13",
    }
    assert not planted.exists()
    assert run_replicas(run_b)["worker-0"] == replica_b  # run B's replica runs on, untouched

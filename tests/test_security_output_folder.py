"""Replicas write one folder of their run directory, their output folder (``RunPaths.output``), and
nothing else of it: a hostile process in a replica's real sandbox tries to make or replace what the
pipeline's stages write at the run directory's top (their records, the weights a stage reads, the
folders they write into, a receipt), before and after the pipeline renames a record in, and writes
what a replica writes in its output folder."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
from conftest import ATTEMPT, replica_sandbox, run_sandboxed_around

from hetflow.paths import write_record

_HOSTILE = ATTEMPT + textwrap.dedent(
    """
    import json, os, sys
    top, output, checkpoints = json.loads(sys.argv[1])
    def write(path, text="{}"):
        with open(path, "w") as handle:
            handle.write(text)
    def swap(name):  # a file made where it may write, renamed over the pipeline's
        write(output + "/forged")
        os.replace(output + "/forged", top + "/" + name)
    for name in ("evaluation.json", "export.json", "registry.json", "summary.json", "model.weights.h5",
                 "training.json", "plan.json", "attempts/train.json", "logs/worker-0.log", "plots/curve.png"):
        attempt("create " + name, lambda: write(top + "/" + name))
    attempt("swap spec.json", lambda: swap("spec.json"))
    attempt("remove spec.json", lambda: os.unlink(top + "/spec.json"))
    attempt("mkdir export", lambda: os.mkdir(top + "/export"))
    attempt("link compressed", lambda: os.symlink("/etc", top + "/compressed"))
    attempt("move output", lambda: os.rename(output, top + "/moved"))
    attempt("write training.json", lambda: write(output + "/training.json"))
    attempt("write model.weights.h5", lambda: write(output + "/model.weights.h5", "weights"))
    attempt("write checkpoint", lambda: (os.makedirs(checkpoints + "/loop", exist_ok=True),
                                         write(checkpoints + "/loop/ckpt-1.index")))
    print("ready", "ok", flush=True)
    sys.stdin.readline()  # meanwhile evaluate renames its record in
    attempt("rewrite evaluation.json", lambda: write(top + "/evaluation.json", "forged"))
    attempt("swap evaluation.json", lambda: swap("evaluation.json"))
    """
)

_REFUSED = (
    *(
        f"create {name}"
        for name in (
            "evaluation.json",
            "export.json",
            "registry.json",
            "summary.json",
            "model.weights.h5",
            "training.json",
            "plan.json",
            "attempts/train.json",
            "logs/worker-0.log",
            "plots/curve.png",
        )
    ),
    "swap spec.json",
    "remove spec.json",
    "mkdir export",
    "link compressed",
    "move output",
    "rewrite evaluation.json",
    "swap evaluation.json",
)


def _outcome(line: str) -> tuple[str, str]:
    """``("create x", "ok")`` or ``("create x", "OSError 30")`` of an ATTEMPT line (labels hold spaces)."""
    if line.endswith(" ok"):
        return line.removesuffix(" ok"), "ok"
    label, error, number = line.rsplit(" ", 2)
    return label, f"{error} {number}"


@pytest.mark.skipif(os.geteuid() != 0, reason="hands the output folder to the sandbox's uid as provisioning does")
def test_a_replica_writes_its_output_folder_and_nothing_else_of_its_run_directory(hetflow_env):
    from hetflow import sandbox

    if sandbox.unavailable():
        pytest.skip(sandbox.unavailable())
    paths, box = replica_sandbox("test_output_folder", "attempts", "plots")
    assert os.lstat(paths.root).st_uid == os.geteuid()  # the run directory stays the pipeline's
    output = paths.training.parent
    targets = json.dumps([str(paths.root), str(output), str(paths.checkpoints)])
    # Meanwhile evaluate renames its record in.
    hostile = run_sandboxed_around(
        box, [sys.executable, "-c", _HOSTILE, targets], lambda: write_record(paths.evaluation, {"accuracy": 0.9})
    )
    assert hostile.returncode == 0, hostile.stderr
    outcome = dict(_outcome(line) for line in hostile.stdout.splitlines())
    assert {label: outcome[label] for label in _REFUSED if outcome[label] == "ok"} == {}
    for written in ("write training.json", "write model.weights.h5", "write checkpoint"):
        assert outcome[written] == "ok", f"{written}: {outcome[written]}"
    # What is at the top is the pipeline's alone: its records whole, nothing of the replica's there.
    assert json.loads(paths.evaluation.read_text()) == {"accuracy": 0.9}
    assert json.loads(paths.spec.read_text())["cluster"]["strategy"] == "multi_worker_mirrored"
    made = {"run_id", "spec.json", "evaluation.json", "logs", "replicas", "attempts", "plots", output.name}
    assert sorted(os.listdir(paths.root)) == sorted(made)
    assert os.listdir(paths.root / "attempts") == [] and os.listdir(paths.plots) == []
    assert (output / "model.weights.h5").read_text() == "weights"

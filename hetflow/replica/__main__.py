"""The entry point of every replica, in every backend: ``python -m hetflow.replica --run-dir DIR``.

The replica learns its role from ``TF_CONFIG`` and the run from the run directory (spec.json and
dataset.json, written by earlier stages). In a container, which no keeper ends,
``--watch-supervisor`` makes it end itself once the run's supervisor is gone (``hetflow.cluster.lease``).

A replica leaves with ``os._exit`` once its work is done and its output flushed, skipping Python's
interpreter finalization: there, under multi_worker_mirrored, the garbage collector destroys
TensorFlow objects tied to the coordination service that the chief, gone first, was hosting, and a
worker took a minute or more to exit (gdb found it in ``Py_FinalizeEx``), long after the chief
(bench/RESULTS.md's "exit after weights" column shows what exiting costs). Every file a replica
writes is closed by then: TensorFlow writes checkpoints synchronously and records are written whole.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from hetflow.cluster.lease import SIGNALS, SupervisorWatch
from hetflow.paths import RunPaths
from hetflow.records import DatasetRecord
from hetflow.spec import RunSpec


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument(
        "--watch-supervisor",
        action="append",
        choices=SIGNALS,
        default=[],
        help="end this replica once the run's supervisor is gone, as this signal of it shows (container "
        "backends; a local replica's keeper watches for it)",
    )
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    paths = RunPaths(args.run_dir)
    spec = RunSpec.from_json(paths.spec.read_text())
    dataset = DatasetRecord.read(paths)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    print(f"replica {task['type']}-{task['index']} pid {os.getpid()} strategy={spec.cluster.strategy}", flush=True)

    run_replica(spec, dataset, paths, task)


def run_replica(spec: RunSpec, dataset: DatasetRecord, paths: RunPaths, task: dict[str, Any]) -> None:
    """This replica's part: serving variables and steps (parameter_server's ps and workers,
    model_parallel's stages across workers), or training with the spec's strategy and writing its
    results."""
    from hetflow.replica.runtime import configure_runtime, serve

    configure_runtime(spec, task)
    from hetflow.replica import model_parallel, parameter_server, sync
    from hetflow.replica.balance import Probed
    from hetflow.replica.record import finish

    if spec.cluster.chief_coordinates and task["type"] != "chief":
        serve(spec, task)
        return
    train = {"parameter_server": parameter_server.train, "model_parallel": model_parallel.train}.get(
        spec.cluster.strategy, sync.train
    )
    try:
        trained = train(spec, dataset, paths, task)
    except Probed as probed:
        print(f"{probed}: stopping, strategy=auto decides", flush=True)
        return
    finish(spec, dataset, paths, trained)


def run_and_exit() -> None:
    """``main``, then leave at once (see the module's docstring): 0 on success, 1 on an error,
    after printing its traceback (``hetflow.cluster.lease.SUPERVISOR_GONE_EXIT_CODE`` where its supervisor
    is gone)."""
    code, watch = 0, None
    try:
        args = parse_arguments()
        watch = SupervisorWatch(args.run_dir, args.watch_supervisor) if args.watch_supervisor else None
        main(args)
    except SystemExit as leaving:  # argparse's usage errors keep their code
        code = leaving.code if isinstance(leaving.code, int) else int(leaving.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
        if watch is not None:
            # Where the supervisor is gone, a peer that saw it first has left, and this replica
            # failed in a step they share before its own watch looked: one look now says why.
            watch.look()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()

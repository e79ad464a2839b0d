"""Entry point of every replica, in every backend: ``python -m tasks.replica --run-dir DIR``.

The replica learns its role from ``TF_CONFIG`` and the run from the run directory (spec.json and
dataset.json, written by earlier stages).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tasks.paths import RunPaths
from tasks.spec import RunSpec


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--probe", action="store_true", help="measure this worker's speed alone, then exit")
    args = parser.parse_args(argv)
    paths = RunPaths(args.run_dir)
    spec = RunSpec.model_validate_json(paths.spec.read_text())
    dataset = json.loads(paths.dataset.read_text())
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    print(f"replica {task['type']}-{task['index']} pid {os.getpid()} strategy={spec.strategy}", flush=True)

    from tasks.strategies import run_replica

    run_replica(spec, dataset, paths, task, probe=args.probe)


if __name__ == "__main__":
    main()

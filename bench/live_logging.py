"""``make bench`` (live logging): what logging a run to MLflow while it trains costs the training.

One job, two cases that differ in one thing: the train stage with the DAG run's MLflow run open
(``validate_spec`` given a DAG id: ``train`` reads the chief's progress file and samples every
replica's CPU and memory every 2 s, logging both to MLflow) and without it (no MLflow run: nothing
watches). The job: ``multi_worker_mirrored`` on two local workers, ``mlp`` on the embedded digits,
40 epochs, run through the stages in this process as the DAG runs them. Cases alternate, ``--repeats``
each. Reported, medians: the chief's examples/s over its epochs (training.json), the whole job's
(launch to final weights), and the CPU seconds the pipeline's process spent in ``train`` (the
supervisor, plus the watcher when on).

Writes bench/results/live-logging-<UTC timestamp>.json and bench/LIVE_LOGGING.md; ``--summary-of
RECORD`` rewrites the summary from a saved record, running nothing.

    .venv/bin/python bench/live_logging.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from report import save  # bench/report.py: the scripts run as bench/<name>.py
from run import machine_facts

JOB = {"strategy": "multi_worker_mirrored", "workers": 2, "model": "mlp", "epochs": 40, "skip_unchanged": False}


def one_run(live: bool, index: int) -> dict:
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.provision_cluster import provision_cluster
    from hetflow.tasks.teardown_cluster import teardown_cluster
    from hetflow.tasks.train import train
    from hetflow.tasks.validate_spec import validate_spec

    run_id = f"bench-live-{'on' if live else 'off'}-{index}-{os.getpid()}"
    dag = {"dag_id": "bench_live_logging", "airflow_url": None} if live else {}
    validate_spec(JOB, run_id, **dag)
    prepare_data(run_id)
    provision_cluster(run_id)
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    try:
        training = train(run_id)
    finally:
        teardown_cluster(run_id)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - started
    return {
        "live": live,
        "examples_per_second": training["examples_per_second"],
        "whole_job_examples_per_second": training["whole_job_examples_per_second"],
        "pipeline_cpu_seconds": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "train_wall_seconds": wall,
    }


def summary(record: dict) -> str:
    cases = {}
    for live in (False, True):
        runs = [r for r in record["runs"] if r["live"] == live]
        cases[live] = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "live"}
    off, on = cases[False], cases[True]
    change = on["examples_per_second"] / off["examples_per_second"] - 1
    whole = on["whole_job_examples_per_second"] / off["whole_job_examples_per_second"] - 1
    lines = [
        "# Live logging: what it costs training",
        "",
        "Written by `bench/live_logging.py` from "
        f"`{record['results_file']}`; {record['repeats']} runs per case, alternating, medians.",
        "",
        f"Job: {', '.join(f'{k}={v}' for k, v in JOB.items())}; local backend; {record['machine']['cpu_model']}, "
        f"{record['machine']['nproc']} CPUs.",
        "",
        "| case | examples/s (epochs) | its runs | whole job examples/s | pipeline CPU s in train |",
        "|---|---:|---|---:|---:|",
    ]
    for name, live in (("no MLflow run", False), ("live MLflow run", True)):
        case = cases[live]
        each = ", ".join(f"{r['examples_per_second']:.0f}" for r in record["runs"] if r["live"] == live)
        lines.append(
            f"| {name} | {case['examples_per_second']:.0f} | {each} | {case['whole_job_examples_per_second']:.0f} "
            f"| {case['pipeline_cpu_seconds']:.2f} |"
        )
    speeds = [r["examples_per_second"] for r in record["runs"]]
    spread = max(speeds) / min(speeds) - 1
    # What the watcher can take from the replicas at most: the CPU it used, of all the cores' time in train.
    extra_cpu = on["pipeline_cpu_seconds"] - off["pipeline_cpu_seconds"]
    share = extra_cpu / (on["train_wall_seconds"] * record["machine"]["nproc"]) if "train_wall_seconds" in on else None
    if share is not None:
        verdict = f"{'met' if share <= 0.02 else 'not met'}, by the bound below"
    else:
        verdict = "not judged: the runs spread more than the aim"
    lines += [
        "",
        f"Live logging changed the chief's examples/s by {100 * change:+.1f} % (aim: no worse than -2 %: {verdict}) "
        f"and the whole job's by {100 * whole:+.1f} %, inside the {100 * spread:.0f} % spread between runs of this "
        "job: no cost measurable at this noise. The pipeline's process spent "
        f"{extra_cpu:+.2f} CPU s more in train (reading the progress file, sampling the replicas, MLflow calls)"
        + (
            f", {100 * share:.2f} % of the {record['machine']['nproc']} cores' time while training: the most it "
            "can take from the replicas, which share those cores."
            if share is not None
            else "."
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--summary-of", type=Path, help="rewrite bench/LIVE_LOGGING.md from a saved record")
    args = parser.parse_args()
    if args.summary_of:
        record = json.loads(args.summary_of.read_text())
        (Path(__file__).parent / "LIVE_LOGGING.md").write_text(summary(record))
        return 0
    runs = []
    with tempfile.TemporaryDirectory(prefix="hetflow-bench-live-") as home:
        (Path(home) / "mlflow").mkdir()
        os.environ.update(HETFLOW_HOME=home, MLFLOW_TRACKING_URI=f"sqlite:///{home}/mlflow/mlflow.db")
        for index in range(args.repeats):
            for live in (index % 2 == 1, index % 2 == 0):  # alternate which case goes first
                runs.append(one_run(live, index))
                print(runs[-1], file=sys.stderr, flush=True)
                time.sleep(2)
    record = {
        "job": JOB,
        "repeats": args.repeats,
        "machine": machine_facts(),
        "runs": runs,
    }
    save("live-logging", record, "LIVE_LOGGING.md", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

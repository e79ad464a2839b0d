"""``make bench-overhead``: what a default run costs beside its training, and where that goes.

Runs ``hetflow run`` with the given arguments (the Makefile passes ``make run``'s RUN_SPEC) ``--runs``
times, each in a temporary HETFLOW_HOME and MLflow store of its own, after a set-up that a user's
first ``make run`` pays once: the dataset prepared, Airflow's metadata DB and the MLflow store
created. The run measured is then what every later run that trains costs. Just before each run,
one TensorFlow import is timed in a fresh interpreter (median of 3): the yardstick of the aim; and,
in another fresh interpreter of the same venv, the import of each stage's module in DAG order:
import cost measured apart, as nothing in hetflow times imports.

Figures, from the run's summary.json (``timings``, see hetflow/tasks/summarize.py and hetflow/pipeline/timing.py):
- the headline: the command's wall time, launch to exit, less the training, against
  ``AIM_IMPORTS`` times one TensorFlow import measured in the same run;
- the DAG's wall time, from the DAG run's start to ``summarize``; the training's, the replicas'
  whole job (their launch to the final weights written); the fixed overhead, the one less the other;
- per stage: its wall time = MLflow I/O + work (exclusive parts, on the stage's thread);
- Airflow's time outside every stage (its start-up before the first task, task bookkeeping,
  teardown_cluster);
- beside them the command's own wall time, launch to exit (Python, Airflow and the DAG files
  loaded before the DAG run starts), and the served checks' start-up, which bounds register;
- apart, what importing each stage's module costs in DAG order (``hetflow.tasks.<stage>``, each
  after the ones before it: what a one-process run pays for it by that stage);
- apart, the Airflow floor: the launch to exit of a run of hetflow_train's shape with empty tasks
  (bench/airflow_floor/), in an Airflow home of its own; with the stages after training's imports,
  what the run cannot shed by changing its stages.

Writes bench/results/overhead-<UTC timestamp>.json and bench/OVERHEAD.md.

    python bench/overhead.py --set strategy=multi_worker_mirrored --set workers=2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from overhead_yardsticks import (
    IMPORT_REPEATS,
    BenchFailed,
    airflow_floor_seconds,
    checked,
    set_up,
    stage_import_seconds,
    tensorflow_import_seconds,
)
from report import busy_cores, other_work_line, save  # bench/report.py: the scripts run as bench/<name>.py
from run import machine_facts, shown
from throughput_cases import BIN, REPO_ROOT

from hetflow.pipeline.timing import PARTS

AIM_IMPORTS = 3  # the aim: the command less its training, at most this many TensorFlow imports
STAGES_AFTER_TRAINING = ("evaluate", "compress", "export", "register", "summarize")
_PART_NAMES = {
    "mlflow_io": "MLflow I/O",
    "serving": "model servers",
    "fine_tuning": "fine-tuning",
    "tflite_conversion": "TFLite conversion",
    "work": "work",
}


def measure(command: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run ``hetflow run`` once; its wall time and its summary.json."""
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - started
    checked(done, "hetflow run")
    summary = json.loads(Path(done.stdout.strip().splitlines()[-1]).read_text())
    if summary["status"] != "success" or not summary.get("timings"):
        raise BenchFailed(f"hetflow run ended {summary['status']} ({summary.get('skipped_because')})")
    return {"command_seconds": wall, "summary": summary}


def figures(measured: dict[str, Any]) -> dict[str, Any]:
    """What the report shows, from the run's wall time and summary."""
    summary = measured["summary"]
    timings = summary["timings"]
    served = [model["served"] for model in (summary["registry"] or {}).get("models", []) if model.get("served")]
    return {
        "command_seconds": measured["command_seconds"],
        "dag_seconds": timings["dag_seconds"],
        "training_seconds": timings["training_seconds"],
        "fixed_overhead_seconds": timings["fixed_overhead_seconds"],
        "command_overhead_seconds": measured["command_seconds"] - timings["training_seconds"],
        "before_dag_seconds": measured["command_seconds"] - timings["dag_seconds"],
        "airflow_seconds": timings["airflow_seconds"],
        "airflow_before_first_stage_seconds": timings["airflow_before_first_stage_seconds"],
        "stages": timings["stages"],
        "parts": {part: sum(stage[part] for stage in timings["stages"].values()) for part in PARTS},
        "served_checks": [
            {key: check.get(key) for key in ("model_uri", "start_seconds", "seconds", "passed")} for check in served
        ],
    }


def tensorflow_import(run: dict[str, Any]) -> float:
    """The run's yardstick: one TensorFlow import, the median of its repeats."""
    return statistics.median(run["tensorflow_import_seconds"])


def headline(run: dict[str, Any]) -> dict[str, float]:
    """The run's command less its training against its TensorFlow import."""
    tf_import = tensorflow_import(run)
    overhead = run["figures"]["command_overhead_seconds"]
    return {"overhead": overhead, "tf_import": tf_import, "imports": overhead / tf_import}


def floor(run: dict[str, Any]) -> dict[str, float]:
    """What no change to hetflow's stages can shed from the run: Airflow's own cost of a run of this
    DAG (the Airflow floor) and the import of the stages after training, which bring TensorFlow into
    the DAG's process; seconds, and in TensorFlow imports."""
    tf_import = tensorflow_import(run)
    imports_after_training = sum(
        seconds for task, seconds in run["stage_import_seconds"].items() if task in STAGES_AFTER_TRAINING
    )
    seconds = run["airflow_floor_seconds"] + imports_after_training
    return {
        "airflow": run["airflow_floor_seconds"],
        "airflow_imports": run["airflow_floor_seconds"] / tf_import,
        "imports_after_training": imports_after_training,
        "seconds": seconds,
        "imports": seconds / tf_import,
    }


def floor_verdict(run: dict[str, Any]) -> str:
    bound = floor(run)
    return (
        f"**What bounds it:** Airflow alone, a run of the same DAG with every task's body empty (its ten tasks, "
        f"their wiring, trigger rules, set-up and teardown, its trigger form: `bench/airflow_floor/`) through "
        f"the same `dag.test`, took {bound['airflow']:.1f} s from launch to exit, "
        f"{bound['airflow_imports']:.1f}× an import. With the "
        f"stages after training importing TensorFlow into the DAG's process ({bound['imports_after_training']:.1f} s, "
        f"below), that is {bound['seconds']:.1f} s, {bound['imports']:.1f}× an import, before any stage does its "
        f"work: {'above' if bound['imports'] > AIM_IMPORTS else 'within'} the aim of {AIM_IMPORTS}×."
    )


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose overhead, in TensorFlow imports, is the median (the lower middle of an even count)."""
    return sorted(runs, key=lambda run: headline(run)["imports"])[(len(runs) - 1) // 2]


def markdown(report: dict[str, Any]) -> str:
    runs = report["runs"]
    middle = median_run(runs)
    lines = [
        *_headline_lines(report, middle),
        "",
        floor_verdict(middle),
        "",
        *_runs_table(runs, middle),
        *_median_run_lines(middle["figures"]),
        *_stage_import_table(middle),
        *_served_checks_lines(middle["figures"]),
        *_set_up_lines(middle),
    ]
    return "\n".join(lines) + "\n"


def _headline_lines(report: dict[str, Any], middle: dict[str, Any]) -> list[str]:
    """The title, what ran on which machine, and the median run's overhead against the aim."""
    machine, runs = report["machine"], report["runs"]
    result = middle["figures"]
    ratios = [headline(run)["imports"] for run in runs]
    met = headline(middle)["imports"] <= AIM_IMPORTS
    airflow_own = result["before_dag_seconds"] + result["airflow_seconds"]
    after_training = sum(timing["wall"] for stage, timing in result["stages"].items() if stage in STAGES_AFTER_TRAINING)
    busy = [run["busy_cores_before"] for run in runs]
    return [
        "# Fixed pipeline overhead",
        "",
        f"The default run (`make run`'s spec) through `hetflow run`; runs: {len(runs)}, each in a temporary "
        "`HETFLOW_HOME` and MLflow store of its own whose first-use set-up (dataset, Airflow's metadata DB, "
        "MLflow store) was done beforehand. Just before each run, `import tensorflow` was timed in a fresh "
        f"interpreter ({IMPORT_REPEATS} times, median).",
        "",
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        f"- machine: {machine['nproc']} CPUs ({machine['cpu_model']}), {machine['memory_gib']} GiB memory, "
        f"TensorFlow {machine['tensorflow']}, Python {machine['python']}, git {machine['git']}",
        other_work_line(busy, "before each run"),
        "",
        f"**Fixed overhead: {headline(middle)['overhead']:.1f} s, {headline(middle)['imports']:.1f}× one TensorFlow "
        f"import** (median run; runs {min(ratios):.1f}–{max(ratios):.1f}×); aim ≤ {AIM_IMPORTS}×: "
        f"{'met' if met else 'not met'}. Of it, Airflow's own time (before and after the DAG run, and outside "
        f"every stage) was {airflow_own:.1f} s, {airflow_own / headline(middle)['tf_import']:.1f}× an import, "
        f"and the stages after training (evaluate to summarize) {after_training:.1f} s.",
    ]


def _runs_table(runs: list[dict[str, Any]], middle: dict[str, Any]) -> list[str]:
    lines = [
        "| run | launch to exit | training | launch to exit − training | one TensorFlow import | in imports |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for number, run in enumerate(runs, 1):
        figures_, measured = run["figures"], headline(run)
        lines.append(
            f"| {number}{' (median)' if run is middle else ''} | {figures_['command_seconds']:.1f} | "
            f"{figures_['training_seconds']:.1f} | {measured['overhead']:.1f} | {measured['tf_import']:.2f} | "
            f"{measured['imports']:.1f}× |"
        )
    return lines


def _median_run_lines(result: dict[str, Any]) -> list[str]:
    """The median run's ``figures``: the command's and the DAG's time, then each stage's parts."""
    parts = list(result["parts"])  # as the results file holds them: older ones have MLflow I/O and work only
    lines = [
        "",
        "The median run in detail (seconds):",
        "",
        "| | seconds |",
        "|---|---:|",
        f"| `hetflow run`, launch to exit | {result['command_seconds']:.1f} |",
        f"| of it before the DAG run starts and after it ends (Python, Airflow, DAG files) | "
        f"{result['before_dag_seconds']:.1f} |",
        f"| DAG wall time (DAG run start to `summarize`) | {result['dag_seconds']:.1f} |",
        f"| training (the replicas' whole job, launch to final weights) | {result['training_seconds']:.1f} |",
        f"| DAG wall time − training | {result['fixed_overhead_seconds']:.1f} |",
        "",
        f"Where the DAG's wall time went, per stage (wall = {' + '.join(_PART_NAMES[p] for p in parts)}):",
        "",
        f"| stage | wall | {' | '.join(_PART_NAMES[p] for p in parts)} |",
        f"|---|---:|{'---:|' * len(parts)}",
    ]
    for stage, timing in result["stages"].items():
        lines.append(f"| {stage} | {timing['wall']:.1f} | {' | '.join(f'{timing[p]:.1f}' for p in parts)} |")
    in_stages = sum(timing["wall"] for timing in result["stages"].values())
    return [
        *lines,
        f"| all stages | {in_stages:.1f} | {' | '.join(f'{seconds:.1f}' for seconds in result['parts'].values())} |",
        f"| Airflow, outside every stage (of it before the first: "
        f"{result['airflow_before_first_stage_seconds']:.1f}) | {result['airflow_seconds']:.1f} |{' |' * len(parts)}",
        "",
    ]


def _stage_import_table(run: dict[str, Any]) -> list[str]:
    lines = [
        "What importing each stage's module costs, in DAG order, in a fresh interpreter of the same venv "
        "(measured apart, just before the run; each after the ones above it, as one process imports them; "
        "what a stage imports inside its function is not in it, but in its work above):",
        "",
        "| stage's module | import | by this stage |",
        "|---|---:|---:|",
    ]
    by_now = 0.0
    for task, seconds in run["stage_import_seconds"].items():
        by_now += seconds
        lines.append(f"| `hetflow.tasks.{task}` | {seconds:.2f} | {by_now:.2f} |")
    lines.append("")
    return lines


def _served_checks_lines(result: dict[str, Any]) -> list[str]:
    if not result["served_checks"]:
        return []
    return [
        "register's served checks, each a model server started for the check (running together):",
        "",
        *(
            f"- `{check['model_uri']}`: up in {check['start_seconds']:.1f} s, check done in {check['seconds']:.1f} s"
            for check in result["served_checks"]
            if check["start_seconds"] is not None
        ),
        "",
    ]


def _set_up_lines(run: dict[str, Any]) -> list[str]:
    """The home's first-use set-up, outside the run, and what the stages' parts hold."""
    set_up_seconds = ", ".join(f"{step.replace('_', ' ')} {seconds:.1f} s" for step, seconds in run["set_up"].items())
    return [
        f"First use of the home, before the run and not in it: {set_up_seconds}.",
        "",
        "train's wall time holds the training but for the replicas' start-up in provision_cluster; MLflow I/O: "
        "calls to MLflow's client and `log_model`; work: the rest, the stage's imports (one process runs every "
        "task: each module is imported once, by the first stage that needs it), waiting for the replicas and "
        "the served checks' model servers included.",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=1200, help="seconds each run may take")
    parser.add_argument("--runs", type=int, default=3, help="runs, each in a fresh home (default 3)")
    # Everything else is hetflow run's (--set KEY=VALUE ..., --config FILE).
    args, run_args = parser.parse_known_args()
    command = [str(BIN / "hetflow"), "run", *run_args]

    started_at = datetime.now(timezone.utc)
    runs = []
    for number in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="hetflow-overhead-") as home:
            env = {**os.environ, "HETFLOW_HOME": home, "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db"}
            try:
                print(f"[bench] run {number}/{args.runs}: setting up {home} ...", flush=True)
                set_up_seconds = set_up(run_args, env)
                tf_import = tensorflow_import_seconds(env)
                stage_imports = stage_import_seconds(env)
                floor_seconds = airflow_floor_seconds(env)
                # Other work on the machine skews every figure: what kept the cores busy just before the
                # run, the bench waiting, shows whether some was going on.
                busy_before = busy_cores()
                print(f"[bench] {shown(command)} ...", flush=True)
                measured = measure(command, env, args.timeout)
            except (BenchFailed, subprocess.TimeoutExpired) as error:
                print(f"[bench] {error}", file=sys.stderr)
                return 1
        runs.append(
            {
                "busy_cores_before": busy_before,
                "set_up": set_up_seconds,
                "tensorflow_import_seconds": tf_import,
                "stage_import_seconds": stage_imports,
                "airflow_floor_seconds": floor_seconds,
                "figures": figures(measured),
            }
        )
    report = {
        "date": started_at.isoformat(timespec="seconds"),
        "command": shown([sys.executable, "bench/overhead.py", *sys.argv[1:]]),
        "run_command": shown(command),
        "machine": machine_facts(),
        "aim_tensorflow_imports": AIM_IMPORTS,
        "runs": runs,
    }
    print(save("overhead", report, "OVERHEAD.md", markdown, at=started_at))
    return 0


if __name__ == "__main__":
    sys.exit(main())

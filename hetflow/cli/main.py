"""The hetflow command: validate a spec, run the DAG through Airflow, train only, or sweep leftovers."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import select
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from hetflow.cli import serve as serve_command
from hetflow.cli.dag_run import run_dag
from hetflow.cluster.supervisor import ReplicaFailed
from hetflow.paths import NotRegularFile, hetflow_home, read_replica_record, run_paths
from hetflow.spec import SpecError, flat_values, parse_assignment, parse_spec


def spec_values(config: Path | None, assignments: list[str]) -> dict[str, Any]:
    """The spec's raw values: the config file first, then each ``--set`` over it."""
    values: dict[str, Any] = {}
    if config is not None:
        try:
            values = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecError([f"--config {config}: cannot read a JSON object ({exc})"]) from None
        if not isinstance(values, dict):
            raise SpecError([f"--config {config}: expected a JSON object of spec keys"])
    for assignment in assignments:
        key, value = parse_assignment(assignment)
        values[key] = value
    return values


def _cmd_validate(args) -> int:
    spec = parse_spec(spec_values(args.config, args.set))
    print(json.dumps(spec.model_dump(), indent=2))
    return 0


def _cmd_run(args) -> int:
    from hetflow.data.prepare import data_problems

    values = spec_values(args.config, args.set)
    # Fail here, before Airflow or any replica starts.
    problems = data_problems(parse_spec(values))
    if problems:
        raise SpecError(problems)
    started = time.monotonic()
    # The process id too: two runs started in the same second wrote one log.
    log_name = f"hetflow-run-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.log"
    log_file = None if args.verbose else hetflow_home() / "logs" / log_name
    try:
        summary_path = run_dag(flat_values(values), log_file)  # the conf: short names, as the form's Params
    except KeyboardInterrupt:
        tear_down_runs_provisioned_here()
        return 130
    try:
        summary = read_replica_record(summary_path)
    except FileNotFoundError:
        summary = {"status": "failed"}
    metrics = summary.get("metrics") or {}
    registry = summary.get("registry") or {}
    print(f"\nhetflow run {summary['status']} in {time.monotonic() - started:.0f} s")
    timings = summary.get("timings") or {}
    if timings.get("fixed_overhead_seconds") is not None:
        print(
            f"  time            DAG {timings['dag_seconds']:.0f} s: training {timings['training_seconds']:.0f} s, "
            f"the rest {timings['fixed_overhead_seconds']:.0f} s (where it went: summary.json's timings)"
        )
    if metrics.get("test_accuracy") is not None:
        print(f"  test accuracy   {metrics['test_accuracy']:.4f}")
    for model in registry.get("models") or []:  # the float model, then the TFLite one
        print(f"  registered      {model['model_uri']} aliases={model['aliases']}")
        print(f"  gate            {model['gate']}")
    if summary.get("mlflow_tracking_uri"):
        print(f"  MLflow          {summary['mlflow_tracking_uri']} run {summary['mlflow_run_id']}")
    if summary.get("auto"):
        print(f"  auto            {summary['auto']['decision']['reason']}")
    if summary.get("skipped_because"):
        print(f"  skipped         {summary['skipped_because']}")
    if summary.get("failed_stage"):
        print(f"  failed at       {summary['failed_stage']}")
    if summary.get("replicas"):
        nodes = summary.get("nodes") or {}
        names = (f"{r['role']}-{r['index']}" for r in summary["replicas"])
        replicas = ", ".join(f"{name} on {nodes[name]}" if name in nodes else name for name in names)
        spec = flat_values(summary["spec"])  # flat in a run directory from before the sections
        print(f"  replicas        {replicas} ({spec['backend']}, {spec['strategy']})")
    if log_file is not None:
        print(f"  full log        {log_file}")
    print(summary_path)
    return 0 if summary["status"] in ("success", "skipped") else 1


def tear_down_runs_provisioned_here() -> list[str]:
    """End the replicas of every run this process provisioned (its ``provisioned_by.json`` names
    this process): `hetflow run` interrupted, its DAG's teardown task will not run. Returns the run ids."""
    from hetflow.pipeline.provisioned_by import provisioned_here
    from hetflow.tasks.teardown_cluster import teardown_cluster

    run_ids = provisioned_here(hetflow_home())
    for run_id in run_ids:
        print(f"\ninterrupted: tearing down {run_id}", file=sys.stderr)
        teardown_cluster(run_id)
    return run_ids


def train_run_id() -> str:
    """A run id for `hetflow train`: its start time, readable, and a random part, so that two
    commands started in the same second (a bench's side-by-side jobs) get run directories of their own."""
    return f"train__{time.strftime('%Y%m%dT%H%M%S')}_{uuid.uuid4().hex[:8]}"


def _cmd_train(args) -> int:
    """Only the training stage (validate, prepare, provision, train, teardown): for development."""
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.provision_cluster import provision_cluster
    from hetflow.tasks.teardown_cluster import teardown_cluster
    from hetflow.tasks.train import train
    from hetflow.tasks.validate_spec import validate_spec

    run_id = train_run_id()
    validate_spec(spec_values(args.config, args.set), run_id)
    prepare_data(run_id)
    provision_cluster(run_id)
    try:
        training = train(run_id)
    finally:
        teardown_cluster(run_id)
    print(json.dumps({k: v for k, v in training.items() if k != "history"}, indent=2))
    print(run_paths(run_id).training)
    return 0


def _cmd_tune(args) -> int:
    """The hetflow_tune DAG once: a study from --config (the tune form's fields as JSON), its base
    spec amended by --set."""
    from hetflow.tuning.form import study_values
    from hetflow.tuning.space import parse_study

    form = spec_values(args.config, [])
    form["base"] = {**form.get("base", {}), **spec_values(None, args.set)}
    parse_study(study_values(form))  # refused here, one line per problem, before Airflow starts
    log_name = f"hetflow-tune-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.log"
    log_file = None if args.verbose else hetflow_home() / "logs" / log_name
    try:
        summary_path = run_dag(form, log_file, dag_id="hetflow_tune")
    except KeyboardInterrupt:
        tear_down_runs_provisioned_here()
        return 130
    if not summary_path.exists():
        print(f"\nhetflow tune failed: the log is {log_file or 'above'}", file=sys.stderr)
        return 1
    summary = read_replica_record(summary_path)
    print(f"\nhetflow tune: best trial {summary['best_trial']} ({summary['best_run_id']})")
    for trial in summary["trials"]:
        target = trial["launch_to_target_seconds"]
        reached = f"target in {target:.1f} s" if target is not None else f"best {trial['best_accuracy']:.4f}"
        print(f"  trial {trial['number']:>3} {trial['state']:<9} {reached:<20} {trial['params']}")
    registry = summary["registry"]
    print(f"  registered      {registry['model_name']} v{registry['version']} {registry['aliases']}")
    print(f"  summary         {summary_path}")
    return 0


def _cmd_sweep(args) -> int:
    """What interrupted runs of this HETFLOW_HOME left: containers, networks, services, Kubernetes objects."""
    from hetflow.cluster.backends.base import sweep

    removed = sweep(hetflow_home())
    for kind, names in removed.items():
        print(f"{kind}: {', '.join(names) if names else 'none left'}")
    return 0


def _output_reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (poll reports an error on it)."""
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _tools_write_under_home() -> None:
    """What the libraries of a run would write into the user's home on first use goes under
    HETFLOW_HOME, with everything else the run writes: Keras' config file and matplotlib's font cache.
    MLflow's client would also record an installation id there and send usage telemetry from the
    run's processes: off, unless the user set MLFLOW_DISABLE_TELEMETRY. What the user set stays. Set
    before any thread starts, and inherited by every process of the run."""
    tools = hetflow_home() / "tools"
    os.environ.setdefault("KERAS_HOME", str(tools / "keras"))
    os.environ.setdefault("MPLCONFIGDIR", str(tools / "matplotlib"))
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetflow", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, handler, text in (
        ("validate", _cmd_validate, "check a spec and print it with defaults filled in"),
        ("run", _cmd_run, "run the hetflow_train DAG once through Airflow"),
        ("train", _cmd_train, "run only the training stage"),
        ("tune", _cmd_tune, "run the hetflow_tune DAG once: a study for the fastest settings to a target accuracy"),
        ("sweep", _cmd_sweep, "remove what interrupted runs left: containers, networks, services, pods"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("--config", type=Path, help="JSON file of spec keys")
        command.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one key")
        command.add_argument("-v", "--verbose", action="store_true", help="run: print the whole log, not the live view")
        command.set_defaults(handler=handler)
    serve_command.add_parser(commands)
    args = parser.parse_args(argv)
    _tools_write_under_home()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return args.handler(args)
    except SpecError as exc:
        for problem in exc.problems:
            print(f"hetflow: invalid spec: {problem}", file=sys.stderr)
        return 2
    except NotRegularFile as exc:  # a record a replica planted or broke: named, not a traceback
        print(f"hetflow: {exc}", file=sys.stderr)
        return 1
    except ReplicaFailed as exc:  # `hetflow train`: which replica ended the run and why, in one line
        print(f"hetflow: train failed: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        if not _output_reader_gone():
            raise  # a pipe or socket of the work itself: a failure, not a reader leaving
        # The output's reader left (`hetflow validate | head`): stop quietly, as a shell's tools do.
        # What is still buffered goes nowhere, or flushing it at exit would raise once more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    finally:
        # Leaving, the interpreter would walk every object TensorFlow and Airflow made, to collect
        # memory the process gives back anyway: seconds after the command's work was done. Frozen
        # objects are skipped; exit handlers (logging's, MLflow's) still run.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())

"""bench/RESULTS.md, written by bench/run.py from its report."""

from __future__ import annotations

import statistics
from typing import Any

from report import other_work_line
from throughput_bounds import AIM_BOUND_RATIO, AIM_CEILING_SHARE, AIM_EXAMPLES_RATIO, AIM_FIRST_STEP_RATIO, CEILING_PAIR
from throughput_cases import COMMON, PER_WORKER_BATCH

# The parts of training.json's whole_job_breakdown, in the order they happen.
BREAKDOWN = ("start_up", "first_step", "steps", "validation", "between_epochs", "shutdown")


def _number(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        *_header_lines(report),
        *_cases_table(report["cases"]),
        *_breakdown_table(report["cases"]),
        *_peer_lines(report.get("peer")),
        *_ceiling_lines(report.get("ceiling")),
        *_ps_ceiling_lines(report),
        *_collectives_lines(report.get("collectives")),
        *_ps_communication_lines(report.get("ps_communication")),
        *_glossary_and_commands(report["cases"]),
        *_failures(report),
    ]
    return "\n".join(lines) + "\n"


def _header_lines(report: dict[str, Any]) -> list[str]:
    machine, settings = report["machine"], report["settings"]
    return [
        "# Benchmark results",
        "",
        f"Training throughput of `model={COMMON['model']}` (≈1.1 M parameters) on `dataset={COMMON['dataset']}` "
        "(generated 32×32×3 images, 10 classes: synthetic data, see `hetflow/data/synthetic_images.py`), "
        f"{PER_WORKER_BATCH} examples per worker per step, {settings['epochs']} epochs × "
        f"{settings['steps_per_epoch']} steps, median of {settings['repeats']} runs per case.",
        "",
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        f"- machine: {machine['nproc']} CPUs ({machine['cpu_model']}), {machine['memory_gib']} GiB memory, "
        f"TensorFlow {machine['tensorflow']}, tf-keras {machine['tf_keras']}, Python {machine['python']}, "
        f"git {machine['git']}",
        other_work_line([report["busy_cores_before"]], "before the first run"),
    ]


def _cases_table(cases: dict[str, Any]) -> list[str]:
    """Each case's rates (medians) and its ratios to baseline and one_worker."""
    lines = [
        "",
        "| case | what | whole-command examples/s (median) | samples | vs baseline | vs one_worker | "
        "whole-job examples/s | in-epoch examples/s | steady examples/s | time to first step (s) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in cases.items():
        median = result["median"] or {}
        samples = ", ".join(f"{s['whole_command_examples_per_second']:.0f}" for s in result["samples"]) or "–"
        what = result["what"] + (" — **failed**, see below" if result["error"] else "")
        lines.append(
            f"| {name} | {what} | {_number(median.get('whole_command_examples_per_second'))} | {samples} | "
            f"{_number(result['ratio_to_baseline'], 2)} | {_number(result['ratio_to_one_worker'], 2)} | "
            f"{_number(median.get('whole_job_examples_per_second'))} | "
            f"{_number(median.get('examples_per_second'))} | {_number(median.get('steady_examples_per_second'))} | "
            f"{_number(median.get('time_to_first_step_seconds'), 1)} |"
        )
    return lines


def _seconds(result: dict[str, Any], key: str) -> str:
    """A case's median of ``key`` over its samples, with their range where there are several."""
    values = [sample[key] for sample in result["samples"]]
    if not values:
        return "–"
    spread = f" [{min(values):.1f}–{max(values):.1f}]" if len(values) > 1 else ""
    return f"{statistics.median(values):.1f}{spread}"


def _breakdown_table(cases: dict[str, Any]) -> list[str]:
    """Where each case's whole command went: training.json's whole_job_breakdown and the exit after it."""
    lines = [
        "",
        "Where the whole command's time went (medians, seconds; the samples' range in brackets):",
        "",
        "| case | whole command | whole job | "
        + " | ".join(part.replace("_", " ") for part in BREAKDOWN)
        + " | exit after weights |",
        "|---|---:|---:|" + "---:|" * (len(BREAKDOWN) + 1),
    ]
    for name, result in cases.items():
        parts = " | ".join(_seconds(result, f"{part}_seconds") for part in BREAKDOWN)
        lines.append(
            f"| {name} | {_seconds(result, 'whole_command_seconds')} | {_seconds(result, 'whole_job_seconds')} | "
            f"{parts} | {_seconds(result, 'exit_after_weights_seconds')} |"
        )
    return lines


def _peer_lines(peer: dict[str, Any] | None) -> list[str]:
    """Ours against Ray Train on the same job, where both ran."""
    if not peer:
        return []
    examples, first_step = peer["whole_job_examples_per_second_ratio"], peer["time_to_first_step_ratio"]
    return [
        "",
        f"Against a peer, {peer['ours']} / {peer['peer']} (Ray Train, the same job; medians):",
        "",
        "| | ours / Ray's | aim | met |",
        "|---|---:|---:|---|",
        f"| whole-job examples/s | {examples:.2f}× | ≥ {AIM_EXAMPLES_RATIO}× | "
        f"{'yes' if examples >= AIM_EXAMPLES_RATIO else 'no'} |",
        f"| time to first step | {first_step:.2f}× | ≤ {AIM_FIRST_STEP_RATIO}× | "
        f"{'yes' if first_step <= AIM_FIRST_STEP_RATIO else 'no'} |",
        "",
        "ray_2w (bench/ray_peer.py) runs mwms_2's job with Ray's own machinery: the same model, data, "
        "per-worker batch, steps and per-epoch validation, trained with `model.fit` as Ray's guides do, "
        "timed by the same clock from its launch "
        "(`ray.init` and the trainer's start included) to rank 0's final weights written. Where it "
        "differs: its workers are not pinned to cores (Ray's CPUs are logical: it sets no affinity); "
        "its per-epoch checkpoint is Ray's (every worker writes model and optimizer, `ray.train.report` "
        "persists rank 0's) where hetflow's chief alone writes them; its whole job ends at the weights, as "
        "ours does, not when `fit()` returns (`fit_returned_after_seconds` in the JSON).",
    ]


def _ceiling_lines(ceiling: dict[str, Any] | None) -> list[str]:
    """Two synchronous workers against two independent one_worker jobs on a core each."""
    if not ceiling:
        return []
    return [
        "",
        f"Two workers against what two cores give here: {ceiling['ceiling']} (one_worker's job twice at once, "
        f"a core each, no communication) reaches {ceiling['ceiling_vs_one_worker']:.2f}× one_worker's "
        f"whole-command examples/s; {ceiling['case']} reaches {ceiling['case_vs_one_worker']:.2f}×, "
        f"**{ceiling['case_vs_ceiling']:.2f} of that ceiling** (the rest is the all-reduce and the lockstep; "
        f"over the whole job {ceiling['whole_job_case_vs_ceiling']:.2f}); the aim is at least "
        f"{AIM_CEILING_SHARE}: {'met' if ceiling['case_vs_ceiling'] >= AIM_CEILING_SHARE else '**not met**'}.",
    ]


def _ps_ceiling_lines(report: dict[str, Any]) -> list[str]:
    """The parameter-server case against the same ceiling."""
    ps_ceiling = report.get("ps_ceiling")
    if not ps_ceiling:
        return []
    share = ps_ceiling["case_vs_ceiling"]
    return [
        "",
        f"Asynchronous workers against the same ceiling: {ps_ceiling['case']} "
        f"({report['cases'][ps_ceiling['case']]['what']}; each step one worker's batch, applied on the ps) reaches "
        f"{ps_ceiling['case_vs_one_worker']:.2f}× one_worker's whole-command examples/s, **{share:.2f} of "
        f"{ps_ceiling['ceiling']}'s {ps_ceiling['ceiling_vs_one_worker']:.2f}×** (over the whole job "
        f"{ps_ceiling['whole_job_case_vs_ceiling']:.2f}; the sync aim of at least {AIM_CEILING_SHARE} would be "
        f"{'met' if share >= AIM_CEILING_SHARE else '**not met**'}).",
    ]


def _collectives_lines(collectives: dict[str, Any] | None) -> list[str]:
    """mwms_2's all-reduce per step against the same bytes all-reduced over a loopback socket."""
    if not collectives:
        return []
    bound, ratio = collectives["bound"], collectives["ratio_to_bound"]
    runs = ", ".join(f"{1000 * seconds:.1f}" for seconds in collectives["samples"])
    what = (
        f"{collectives['bytes_per_step']} bytes ({', '.join(collectives['dtypes'])}) in "
        f"{collectives['collectives_per_step']} collective(s) ({collectives['implementation']}, "
        f"bytes_per_pack {collectives['bytes_per_pack']})"
    )
    paragraph = (
        f"{collectives['case']}'s all-reduce per step, timed alone by its workers before their first step: "
        f"**{1000 * collectives['seconds_per_step']:.1f} ms** (median of its runs' {runs}) for {what}; "
        "the same bytes all-reduced by two processes over a loopback socket, a core each "
        f"(bench/socket_bound.py, {bound['bytes_sent_per_process']} bytes sent by each): "
        f"{1000 * bound['seconds']:.1f} ms [{1000 * bound['seconds_min']:.1f}–{1000 * bound['seconds_max']:.1f}]; "
        f"**{ratio:.1f}× that bound**, the aim is at most {AIM_BOUND_RATIO:.0f}×: "
        f"{'met' if ratio <= AIM_BOUND_RATIO else '**not met**'}."
    )
    if collectives["ceiling_step_seconds"]:
        step, ceiling_step = collectives["step_seconds"], collectives["ceiling_step_seconds"]
        paragraph += (
            f" In its steps: {1000 * step:.1f} ms per step against {1000 * ceiling_step:.1f} ms for "
            f"{CEILING_PAIR[1]}'s (no all-reduce), {1000 * (step - ceiling_step):.1f} ms more."
        )
    return ["", paragraph]


def _ps_communication_lines(communication: dict[str, Any] | None) -> list[str]:
    """The parameter-server case's communication per step against a loopback socket's round trip."""
    if not communication:
        return []
    bound, ratio = communication["bound"], communication["ratio_to_bound"]
    runs = ", ".join(f"{1000 * seconds:.1f}" for seconds in communication["samples"])
    return [
        "",
        f"{communication['case']}'s communication per step, timed alone through the coordinator before the "
        f"first step: **{1000 * communication['seconds_per_step']:.1f} ms** (median of its runs' {runs}) for "
        f"{communication['bytes_to_worker']} bytes of {communication['variables']} variables read onto a worker "
        f"and {communication['bytes_to_ps']} bytes of update sent back to the ps "
        "(hetflow/replica/ps_exchange.py); the same bytes sent there and back between two processes over a "
        f"loopback socket, a core each (bench/socket_bound.py --pattern {bound['pattern']}): "
        f"{1000 * bound['seconds']:.1f} ms [{1000 * bound['seconds_min']:.1f}–{1000 * bound['seconds_max']:.1f}]; "
        f"**{ratio:.1f}× that bound** (the sync aim of at most {AIM_BOUND_RATIO:.0f}× would be "
        f"{'met' if ratio <= AIM_BOUND_RATIO else '**not met**'}).",
    ]


def _glossary_and_commands(cases: dict[str, Any]) -> list[str]:
    """What the tables' columns mean, and each case's command."""
    return [
        "",
        "whole command: from the command's start to its exit (copies side by side: the last one's); "
        "whole job: from the same start to the final weights written; start up: the start to the first epoch "
        "(process, imports, cluster, model, input pipeline); first step: its tracing; between epochs: "
        "checkpoints; shutdown: last epoch to weights written. in-epoch: examples over the time in epochs "
        "(validation included). steady: the last epoch alone. Absolute numbers vary between machines; "
        "ratios measured in one run are what counts.",
        "",
        "Each case's command (with `HETFLOW_HOME` and `MLFLOW_TRACKING_URI` in a temporary directory):",
        "",
        *(f"- {name}: `{result['command']}`" for name, result in cases.items()),
    ]


def _failures(report: dict[str, Any]) -> list[str]:
    """Each failed case's error, and the socket bound's."""
    lines = []
    for name, result in report["cases"].items():
        if result["error"]:
            lines += ["", f"{name} failed:", "", "```", result["error"], "```"]
    if report.get("socket_bound_error"):
        lines += ["", "socket_bound failed:", "", "```", report["socket_bound_error"], "```"]
    return lines

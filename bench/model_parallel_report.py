"""bench/MODEL_PARALLEL.md, written from a record of bench/model_parallel.py: the pipeline's table and
its verdicts against issue 39's aims, then each pair of split cases (the split by measured time
against the split by parameters, the workers and all else the same), locally and on the swarm."""

from __future__ import annotations

from report import other_work_line

from hetflow.models.stage_split import pipelined_step_seconds

# The aims (issue 39): pipelined >= 1.5x unpipelined at N = 2; each replica <= 0.6 of the model's
# variables and slots; the measured split <= 0.8x the parameter split's time on unequal workers.
PIPELINE_AIM, SHARE_AIM, SPLIT_AIM = 1.5, 0.6, 0.8


def slowest_stage_share(split: dict) -> float:
    """The share of the model's measured cost (plan.json's ``layer_seconds``) its slowest stage holds."""
    seconds, cuts = split["layer_seconds"], [0, *split["bounds"], len(split["layer_seconds"])]
    return max(sum(seconds[start:end]) for start, end in zip(cuts, cuts[1:])) / sum(seconds)


def overlap_ceiling(share: float, micro_batches: int, stages: int = 2) -> float:
    """The unpipelined step over the pipelined one where the stages overlap perfectly and a
    micro-batch costs nothing extra: GPipe's (M+N-1)/M slots of the slowest stage's share."""
    return 1 / ((micro_batches + stages - 1) / micro_batches * share)


def bubble(unpipelined_step: float, pipelined_step: float, stages: int = 2) -> float:
    """The measured share of a stage's time spent waiting (the module's docstring)."""
    return 1 - (unpipelined_step / stages) / pipelined_step


def cores_text(busy: float | None) -> str:
    return "not measured" if busy is None else f"{busy:.2f}"


def core_bound_lines(unpipelined_busy: float | None, cores: int) -> list[str]:
    """What the machine's cores leave pipelining: the work a step does is the same pipelined or not,
    so it can at most fill the cores the unpipelined step leaves idle."""
    if unpipelined_busy is None:
        return []
    return [
        f"- unpipelined, the replicas already keep {unpipelined_busy:.2f} of the machine's {cores} cores busy "
        "(within a stage, one layer's weight and input gradients and each stage's update run side by side; "
        "the chief reads the input): a step that does the same work on these cores can be at most "
        f"{cores / unpipelined_busy:.2f}x faster, whatever the split and the number of micro-batches"
    ]


def summary_text(record: dict) -> str:
    pipeline = record["medians"]["pipeline"]
    lines = [
        *header_lines(record),
        *pipeline_table(record),
        "",
        "## What it shows, against the aims",
        "",
    ]
    one = pipeline.get("stages_mb1", {})
    if not one.get("failed"):
        lines += pipelining_lines(pipeline, record["machine"]["nproc"])
        lines.append(memory_share_line(one))
    lines += data_parallel_lines(pipeline)
    lines += split_lines(
        record, "split", "Unequal workers on this machine: the split by measured time against the split by parameters"
    )
    lines += split_lines(
        record,
        "swarm_split",
        f"Unequal swarm nodes ({record['swarm_nodes']}, CPUs as docker --cpus): the same pairs across two nodes",
    )
    return "\n".join(lines)


def header_lines(record: dict) -> list[str]:
    return [
        "# Model parallelism: pipelining, memory per replica, and the split by measured time",
        "",
        f"Written by `bench/model_parallel.py` from `{record['results_file']}` ({record['when']}); "
        f"{record['machine']['nproc']} cores ({record['machine']['cpu_model']}), TensorFlow "
        f"{record['machine']['tensorflow']}, commit {record['machine']['git']}, {record['repeats']} run(s) per case.",
        other_work_line(record["busy_cores_before"], "before each case"),
    ]


def pipeline_table(record: dict) -> list[str]:
    """The same job data parallel, model parallel and pipelined: one row per case."""
    job = record["cases"]["pipeline"]["stages_mb1"]
    lines = [
        "",
        "## The same job: data parallel, model parallel, pipelined",
        "",
        f"`model={job['model']}` on generated 32x32x3 images, global batch {job['batch_size']}, "
        f"{job['epochs']} epochs x {job['steps_per_epoch']} steps, two workers of one thread each (model parallel: "
        "layer groups cut by parameters; a chief drives them).",
        "",
        "| case | command wall s | whole-job examples/s | first step s | steady examples/s | step s | "
        "cores busy, last epoch | peak RSS MiB per replica | variable + slot MB per worker |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, case in record["medians"]["pipeline"].items():
        if case.get("failed"):
            lines.append(f"| {name} | failed | | | | | | | |")
            continue
        peaks = ", ".join(f"{replica} {mib:.0f}" for replica, mib in case["peak_rss_mib"].items())
        held = (
            ", ".join(
                f"{worker} {((case['variable_bytes'][worker] or 0) + (case['slot_bytes'][worker] or 0)) / 1e6:.0f}"
                for worker in sorted(case["variable_bytes"])
            )
            if any(case["variable_bytes"].values())
            else "each the whole model"
        )
        lines.append(
            f"| {name} | {case['wall_seconds']:.1f} | {case['whole_job_examples_per_second']:.1f} | "
            f"{case['time_to_first_step_seconds']:.1f} | {case['examples_per_second']:.1f} | "
            f"{case['step_seconds']:.2f} | {cores_text(case.get('busy_cores_last_epoch'))} | {peaks} | {held} |"
        )
    return lines


def pipelining_lines(pipeline: dict, cores: int) -> list[str]:
    """Each micro-batch count's step against the unpipelined one (``stages_mb1``, which did not
    fail), what bounds it, and the best against the aim."""
    one = pipeline["stages_mb1"]
    share = slowest_stage_share(one["stage_split"])
    lines = [
        f"- the split's slowest stage holds {share:.2f} of the model's measured cost (the layers are cut whole: "
        f"plan.json's `layer_seconds`), which bounds what pipelining can win where stages overlap perfectly"
    ]
    for micro in (2, 4, 8):
        case = pipeline.get(f"stages_mb{micro}", {})
        if case.get("failed"):
            continue
        theory = 1 / (micro + 1)
        lines.append(
            f"- {micro} micro-batches: step {case['step_seconds']:.2f} s against {one['step_seconds']:.2f} s "
            f"unpipelined ({one['step_seconds'] / case['step_seconds']:.2f}x; aim >= {PIPELINE_AIM}x at the best; "
            f"this split overlapping perfectly: {overlap_ceiling(share, micro):.2f}x); "
            f"bubble measured {bubble(one['step_seconds'], case['step_seconds']):.2f}, theory (N-1)/(M+N-1) = "
            f"{theory:.2f}"
        )
    lines += core_bound_lines(one.get("busy_cores_last_epoch"), cores)
    best = max(
        (pipeline[f"stages_mb{m}"] for m in (2, 4, 8) if not pipeline.get(f"stages_mb{m}", {}).get("failed")),
        key=lambda c: -c["step_seconds"],
        default=None,
    )
    if best:
        speedup = one["step_seconds"] / best["step_seconds"]
        verdict = "meets" if speedup >= PIPELINE_AIM else "falls short of"
        lines.append(
            f"- pipelined at its best: {speedup:.2f}x the unpipelined step, which {verdict} the aim of {PIPELINE_AIM}x"
        )
    return lines


def memory_share_line(one: dict) -> str:
    """Each worker's share of the model's variables and slots in the unpipelined case ``one``, against the aim."""
    total = sum((one["variable_bytes"][w] or 0) + (one["slot_bytes"][w] or 0) for w in one["variable_bytes"])
    shares = [
        ((one["variable_bytes"][w] or 0) + (one["slot_bytes"][w] or 0)) / total for w in sorted(one["variable_bytes"])
    ]
    verdict = "meets" if max(shares) <= SHARE_AIM else "falls short of"
    return (
        f"- each worker's share of the model's variables and slots: {', '.join(f'{s:.2f}' for s in shares)}, "
        f"which {verdict} the aim of at most {SHARE_AIM} (data parallel: 1.00 on each)"
    )


def data_parallel_lines(pipeline: dict) -> list[str]:
    """Data parallelism against the fastest model parallel case, where the model fits one worker."""
    data = pipeline.get("data_parallel", {})
    fastest = min(
        (c for n, c in pipeline.items() if n.startswith("stages") and not c.get("failed")),
        key=lambda c: c["step_seconds"],
        default=None,
    )
    if not fastest or data.get("failed"):
        return []
    return [
        f"- where the model fits: data parallel {data['whole_job_examples_per_second']:.1f} whole-job examples/s, "
        f"the fastest model parallel case {fastest['whole_job_examples_per_second']:.1f} "
        f"({data['whole_job_examples_per_second'] / fastest['whole_job_examples_per_second']:.2f}x in data "
        "parallelism's favour where above 1)"
    ]


def split_lines(record: dict, group: str, title: str) -> list[str]:
    """A table of ``group``'s pairs (``<workers>_by_parameters`` and ``<workers>_by_measured_time``)
    and, per pair, the measured split's step against the parameter split's, the aim and what its plan
    predicted: each split's stage seconds (plan.json) on GPipe's schedule."""
    cases, results = record["cases"][group], record["medians"][group]
    job = next(iter(cases.values()))
    lines = [
        "",
        f"## {title}",
        "",
        f"`model={job['model']}`, global batch {job['batch_size']} in micro_batches {job['micro_batches']}, "
        f"{job['epochs']} epochs x {job['steps_per_epoch']} steps; each pair differs only in `stage_split`.",
        "",
        "| case | worker_devices | layers per worker | step s | steady examples/s | cores busy, last epoch | "
        "command wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, case in results.items():
        devices = f"`{cases[name]['worker_devices']}`"
        if case.get("failed"):
            lines.append(f"| {name} | {devices} | failed | | | | |")
            continue
        layers = "; ".join(f"{w}: {len(layers or [])}" for w, layers in sorted(case["layers"].items()))
        lines.append(
            f"| {name} | {devices} | {layers} | {case['step_seconds']:.3f} | {case['examples_per_second']:.1f} | "
            f"{cores_text(case.get('busy_cores_last_epoch'))} | {case['wall_seconds']:.1f} |"
        )
    lines.append("")
    for pair in dict.fromkeys(name.rsplit("_by_", 1)[0] for name in results):
        measured, by_parameters = results[f"{pair}_by_measured_time"], results[f"{pair}_by_parameters"]
        if measured.get("failed") or by_parameters.get("failed"):
            lines.append(f"- {pair}: a case failed, nothing compared")
            continue
        ratio = measured["step_seconds"] / by_parameters["step_seconds"]
        verdict = "meets" if ratio <= SPLIT_AIM else "falls short of"
        plan, micro_batches = measured["stage_split"], cases[f"{pair}_by_measured_time"]["micro_batches"]
        predicted = pipelined_step_seconds(plan["stage_seconds"], micro_batches) / pipelined_step_seconds(
            plan["parameter_stage_seconds"], micro_batches
        )
        lines.append(
            f"- {pair}: the measured split's step takes {ratio:.2f}x the parameter split's, which {verdict} the aim "
            f"of at most {SPLIT_AIM}x; its plan predicted {predicted:.2f}x"
        )
    return lines

"""``make bench`` (model parallelism, where pipelining's time goes): do two stage replicas compute at
the same time when one chief drives them, forward and backward?

bench/MODEL_PARALLEL.md measured pipelined steps no faster than unpipelined ones on its job (a wide
model at batch 64, whose weight gradients each micro-batch materialises again). This bench takes a
job where micro-batching adds no work: a compute-bound MLP (4 Dense layers of 512 per stage, batch
2048) split over two stage servers (``hetflow.replica.runtime.serve``, each pinned to one core, as
``pin_cores`` runs them), driven by this process as the chief, as ``strategy=model_parallel`` with
workers=2 drives them. Two cases per micro-batch count, differing in one thing: the forward pass
alone over the micro-batches, and hetflow's whole training step (``pipelined_step``: forward,
backward, the update on each stage). Rounds alternate the cases; medians.

Writes bench/results/pipeline-overlap-<UTC timestamp>.json and bench/PIPELINE_OVERLAP.md.

    .venv/bin/python bench/pipeline_overlap.py [--rounds 5] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from report import busy_cores, other_work_line, save  # bench/report.py: the scripts run as bench/<name>.py
from run import machine_facts

from hetflow.cluster.layout import free_local_port

WIDTH, DEPTH, BATCH, CLASSES = 512, 4, 2048, 10
MICRO_BATCHES = (1, 2, 4, 8)
STAGES = 2


def start_stage_servers(cluster: dict) -> list[subprocess.Popen]:
    """Stage i: a TF server as a stage replica runs one (``runtime.serve``), pinned to core i."""
    servers = []
    for index in range(STAGES):
        task = {"type": "worker", "index": index}
        env = {**os.environ, "TF_CONFIG": json.dumps({"cluster": cluster, "task": task}), "TF_CPP_MIN_LOG_LEVEL": "2"}
        code = f"from hetflow.replica.runtime import serve; serve({task!r})"
        servers.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                stdout=subprocess.DEVNULL,
                preexec_fn=lambda core=index: os.sched_setaffinity(0, {core}),
            )
        )
    return servers


def measure(rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per call of each case, by name (``forward_<M>``, ``step_<M>``)."""
    import tensorflow as tf

    from hetflow.replica.model_parallel import micro_batch_sizes, pipelined_step, update_on_each_stage

    devices = [f"/job:worker/replica:0/task:{index}/device:CPU:0" for index in range(STAGES)]
    groups = []
    for index, device in enumerate(devices):
        with tf.device(device):
            layers = [tf.keras.layers.Dense(WIDTH, activation="relu") for _ in range(DEPTH)]
            layers += [tf.keras.layers.Dense(CLASSES)] if index == STAGES - 1 else []
            x = tf.zeros([1, WIDTH])
            for layer in layers:
                x = layer(x)
        groups.append((device, layers))
    images = tf.random.normal([BATCH, WIDTH], seed=1)
    labels = tf.random.uniform([BATCH], 0, CLASSES, tf.int64, seed=2)

    def forward_pass(parts: int):
        @tf.function
        def forward(images):
            logits = []
            for x in tf.split(images, micro_batch_sizes(BATCH, parts)):
                for device, layers in groups:
                    with tf.device(device):
                        for layer in layers:
                            x = layer(x, training=True)
                logits.append(tf.reduce_sum(x))
            return tf.add_n(logits)

        return lambda: forward(images)

    def training_step(parts: int):
        optimizer = tf.keras.optimizers.SGD(0.001)
        update_on_each_stage(optimizer)  # as training does: each update on its stage
        step = pipelined_step(groups, optimizer, BATCH, parts)
        return lambda: step(images, labels)[0]

    cases = {
        f"{kind}_{m}": make(m)
        for m in MICRO_BATCHES
        for kind, make in (("forward", forward_pass), ("step", training_step))
    }
    for call in cases.values():  # traced and warmed before any timing
        float(call())
        float(call())
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, call in cases.items():
            started = time.perf_counter()
            for _ in range(steps):
                float(call())
            samples[name].append((time.perf_counter() - started) / steps)
    return {name: statistics.median(values) for name, values in samples.items()}


def summary(record: dict) -> str:
    seconds = record["seconds"]
    lines = [
        "# Pipelining two stage replicas: forward against the whole step",
        "",
        f"Written by `bench/pipeline_overlap.py` from `{record['results_file']}`; {record['machine']['nproc']} cores "
        f"({record['machine']['cpu_model']}), TensorFlow {record['machine']['tensorflow']}, "
        f"git {record['machine']['git']}.",
        other_work_line(record["busy_before"], "before the run"),
        "",
        f"An MLP of {DEPTH} Dense layers of {WIDTH} per stage (and the logits on the last), batch {BATCH}, over "
        f"{STAGES} stage servers pinned to a core each, driven by one chief as `strategy=model_parallel` drives its "
        f"workers. Medians of {record['rounds']} rounds of {record['steps']} calls, the cases alternating. "
        "Speed-up: the unsplit call's time over the split one's; with perfect overlap two stages reach "
        "2M/(M+1) (GPipe's bubble).",
        "",
        "| micro-batches | forward s | forward speed-up | whole step s | step speed-up | step - forward s | "
        "perfect overlap |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in MICRO_BATCHES:
        forward, step = seconds[f"forward_{m}"], seconds[f"step_{m}"]
        lines.append(
            f"| {m} | {forward:.4f} | {seconds['forward_1'] / forward:.2f}x | {step:.4f} | "
            f"{seconds['step_1'] / step:.2f}x | {step - forward:.4f} | {2 * m / (m + 1):.2f}x |"
        )
    best = max(MICRO_BATCHES, key=lambda m: seconds["step_1"] / seconds[f"step_{m}"])
    lines += [
        "",
        f"The whole step at its best ({best} micro-batches): {seconds['step_1'] / seconds[f'step_{best}']:.2f}x the "
        f"unsplit step, against #39's aim of 1.5x; the forward pass alone: "
        f"{max(seconds['forward_1'] / seconds[f'forward_{m}'] for m in MICRO_BATCHES):.2f}x at its best. "
        "What the step adds to its forward pass (backward and update) is in the 'step - forward' column: "
        "where it does not shrink as micro-batches grow, the stages' backward passes did not overlap.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import hetflow  # noqa: F401  (tf.keras is tf_keras, as in every replica)

    chief, *workers = (f"127.0.0.1:{free_local_port()}" for _ in range(1 + STAGES))
    cluster = {"chief": [chief], "worker": workers}
    busy = [busy_cores()]
    servers = start_stage_servers(cluster)
    try:
        import tensorflow as tf

        from hetflow.replica.model_parallel import wait_for_servers

        wait_for_servers(cluster["worker"])
        tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster), job_name="chief", task_index=0)
        seconds = measure(args.rounds, args.steps)
    finally:
        for server in servers:
            server.kill()
            server.wait()
    record = {
        "job": {"width": WIDTH, "depth_per_stage": DEPTH, "batch": BATCH, "stages": STAGES},
        "rounds": args.rounds,
        "steps": args.steps,
        "busy_before": busy,
        "machine": machine_facts(),
        "seconds": seconds,
    }
    save("pipeline-overlap", record, "PIPELINE_OVERLAP.md", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The probe: a short measured training run on each worker, on its own model (no communication),
with its own devices, threads and throttle, before the cluster trains. All workers are measured
over the same seconds, sharing the machine as they will while training: a slowed worker measured
while the others idled looked 1.2-1.5x faster than it trains. Its examples/s is what
``balance_batches`` and ``strategy=auto`` act on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tasks.data.pipeline import train_input
from tasks.models import build_model, compile_model
from tasks.paths import RunPaths, write_record
from tasks.schedule import make_optimizer
from tasks.spec import RunSpec

BARRIER_TIMEOUT_SECONDS = 300.0
WARMUP_STEPS = 5  # tracing and first-touch costs stay out of the measurement
MIN_MEASURED_STEPS = 10
MIN_MEASURED_SECONDS = 3.0


def measure(
    spec: RunSpec, dataset: dict[str, Any], paths: RunPaths, task: dict[str, Any], barrier=None
) -> dict[str, Any]:
    """Train this worker's share of an even global batch until at least MIN_MEASURED_STEPS steps
    and MIN_MEASURED_SECONDS have passed; write probe/<worker>.json. ``barrier()`` (a collective
    where the workers are connected, ``file_barrier`` where they are not) starts every worker's
    measurement at the same moment, so they share the machine while measured as in training."""
    batch = max(1, spec.batch_size // spec.workers)
    model = build_model(spec.model, dataset["input_shape"], dataset["num_classes"], spec.seed)
    compile_model(model, make_optimizer(spec, spec.learning_rate))
    batches = iter(train_input(dataset, per_worker_batch=batch, shuffle=spec.shuffle, seed=spec.seed))
    for _ in range(WARMUP_STEPS):
        model.train_on_batch(*next(batches))
    if barrier:
        barrier()
    steps, started = 0, time.perf_counter()
    while steps < MIN_MEASURED_STEPS or time.perf_counter() - started < MIN_MEASURED_SECONDS:
        model.train_on_batch(*next(batches))
        steps += 1
    seconds = time.perf_counter() - started
    name = f"{task['type']}-{task['index']}"
    result = {
        "worker": name,
        "batch": batch,
        "steps": steps,
        "step_seconds": seconds / steps,
        "examples_per_second": batch * steps / seconds,
        "model_parameters": model.count_params(),
    }
    paths.probes.mkdir(parents=True, exist_ok=True)
    write_record(paths.probes / f"{name}.json", result)
    print(
        f"probe {name}: {result['examples_per_second']:.0f} examples/s ({1000 * result['step_seconds']:.1f} ms "
        f"per step of {batch})",
        flush=True,
    )
    return result


def file_barrier(directory: Path, worker: str, workers: int):
    """A barrier for probe replicas, which share the run directory but no TF cluster: each marks
    itself ready there and waits for all ``workers`` marks (the provisioner clears them first)."""

    def wait() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{worker}.ready").touch()
        deadline = time.monotonic() + BARRIER_TIMEOUT_SECONDS
        while len(list(directory.glob("*.ready"))) < workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"probe {worker}: not every worker was ready after {BARRIER_TIMEOUT_SECONDS:.0f} s")
            time.sleep(0.01)

    return wait

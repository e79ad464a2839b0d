"""A replica's devices and threads, set from its worker_devices entry before TensorFlow runs an op.

TensorFlow is first imported by ``configure_runtime``: what it reads from the environment when it
loads is set first, and its start-up lines that say nothing to act on stay out of the replica's log.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from hetflow.cluster.output_lines import startup_noise, stderr_captured
from hetflow.spec import RunSpec, WorkerDevice

if TYPE_CHECKING:
    import tensorflow as tf


def replica_device(spec: RunSpec, task: dict[str, Any]) -> WorkerDevice:
    """This replica's device settings: its worker_devices entry; a chief or ps computes nothing
    and takes one CPU."""
    if task["type"] == "worker":
        return spec.cluster.worker_device(task["index"])
    return WorkerDevice()


def replica_threads(spec: RunSpec, task: dict[str, Any]) -> int:
    """This replica's intra- and inter-op threads; 0 leaves TensorFlow's default (one per core)."""
    return replica_device(spec, task).threads or spec.cluster.replica_threads


def load_tensorflow(gpu_wanted: bool) -> None:
    """Import TensorFlow. Its C++ log keeps warnings and errors (its info lines, the coordination
    service's and the gRPC server's start among them, only where TF_CPP_MIN_LOG_LEVEL says so); a
    replica that wants no GPU has TensorFlow list only CPU devices, so it never calls into CUDA,
    which logs an error on a machine without a GPU. What it still prints while it loads
    (``startup_noise``) is left out of the replica's output; every other line is kept."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    if not gpu_wanted:
        os.environ.setdefault("TF_ENABLED_DEVICE_TYPES", "CPU")
    written: list[str] = []
    try:
        with stderr_captured() as written:
            import tensorflow  # noqa: F401
    finally:  # also where the import failed: what TensorFlow said of it is kept
        kept = [line for line in written if not startup_noise(line, gpu_wanted)]
        if kept:
            print("\n".join(kept), file=sys.stderr, flush=True)


def configure_runtime(spec: RunSpec, task: dict[str, Any]) -> None:
    """TensorFlow loaded (``load_tensorflow``), its threads and devices set; must run before it
    executes its first op."""
    device = replica_device(spec, task)
    threads = replica_threads(spec, task)
    load_tensorflow(gpu_wanted=device.device == "gpu")
    import tensorflow as tf

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    gpus = tf.config.list_physical_devices("GPU")
    if device.device == "gpu":
        if len(gpus) < device.count:
            raise RuntimeError(f"this replica asks for {device.count} GPU(s) but sees {len(gpus)}")
        tf.config.set_visible_devices(gpus[: device.count], "GPU")
        return
    tf.config.set_visible_devices([], "GPU")
    if device.count > 1:
        # Split the CPU into logical devices, so mirrored and model-parallel placement run for
        # real (on one machine's cores) with the same code as on several GPUs.
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * device.count)


def local_devices(count: int) -> list[str]:
    """The names of ``count`` local devices: GPUs where there are, else (logical) CPUs."""
    import tensorflow as tf

    devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
    if len(devices) < count:
        raise RuntimeError(f"devices_per_worker={count} but this replica has {len(devices)} devices")
    return [d.name for d in devices[:count]]


def server_config(threads: int) -> tf.compat.v1.ConfigProto:
    """The thread pools of a replica's TF server, which runs the functions a chief sends it: the
    process-wide settings ``configure_runtime`` makes do not reach them (a stage given
    ``threads: 1`` was seen computing on both cores). Its ops get ``threads`` (0: one per core).
    TensorFlow sizes the inter-op pool by the cores the process may use: one thread for a replica
    pinned to a core, with which the chief was seen to wait without end for the first functions it
    sent (a function's ops can block until another of them has run: a receive, for its send). At
    least two."""
    import tensorflow as tf

    inter_op = max(2, threads or len(os.sched_getaffinity(0)))
    return tf.compat.v1.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=inter_op)


def serve(spec: RunSpec, task: dict[str, Any]) -> None:
    """A replica a chief drives (a ps, a worker under parameter_server, a stage of model_parallel
    across workers): run a TF server until the supervisor stops this process."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    config = server_config(replica_threads(spec, task))
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=task["type"],
        task_index=task["index"],
        protocol="grpc",
        config=config,
        start=True,
    )
    address = resolver.cluster_spec().task_address(task["type"], task["index"])
    print(f"{task['type']}-{task['index']} serving at {address}", flush=True)
    server.join()

"""RunSpec: the one typed, validated description of a run.

The Airflow trigger form (``Param``s), ``hetflow run --set key=value`` and JSON config files are
three views of this schema; ``parse_spec`` is the single validation path behind all of them. This
module must stay cheap to import: the DAG file imports it at parse time (no TensorFlow here).
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator


def _field(default: Any, section: str, description: str, **constraints: Any) -> Any:
    """A RunSpec field; give it a ``title`` written for people: the trigger form labels it with that."""
    return Field(default, description=description, json_schema_extra={"section": section}, **constraints)


# Fields only some backends read. The form leaves them optional and sends a cleared one as null,
# which means the field's default: with backend=local nobody has to fill in a Kubernetes namespace.
BACKEND_ONLY_KEYS = (
    "image",
    "replica_cpus",
    "replica_memory_mb",
    "request_gpus",
    "encrypt_network",
    "kubernetes_namespace",
    "kubernetes_volume_claim",
)

STRATEGIES = ("auto", "one_device", "mirrored", "multi_worker_mirrored", "parameter_server", "model_parallel")


class WorkerDevice(BaseModel):
    """One worker of a heterogeneous cluster."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: Literal["cpu", "gpu"] = Field("cpu", description="Device kind the worker computes on.")
    count: int = Field(1, ge=1, le=8, description="Devices of that kind on the worker.")
    threads: int = Field(0, ge=0, le=64, description="TensorFlow intra/inter-op threads; 0 takes replica_threads.")
    slowdown: float = Field(
        1.0,
        ge=1.0,
        le=20.0,
        description="Simulates a slower machine: the worker gets 1/slowdown of the CPU time (local: its "
        "process is stopped and resumed from outside; docker: its container's CPU quota is 1/slowdown of "
        "replica_cpus, or of one core). The training code is unchanged.",
    )
    node: str | None = Field(
        None,
        description="backend=swarm: the swarm node (its hostname) this worker runs on; empty: any node whose "
        "hetflow.device label is this worker's device, or any node where no node has that label.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
    )


class RunSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str = _field(
        "uci_digits",
        "Data",
        "A TFDS dataset name, optionally with a version (`mnist:3.0.1`), or `folder:/ABSOLUTE/PATH`: your own images, "
        "one sub-folder per class (optionally under `train/` and `test/`), in HETFLOW_HOME/data or under a root "
        "the machine's operator allows (HETFLOW_DATA_ROOTS). `uci_digits` is built offline from "
        "the UCI optical digits shipped with scikit-learn; other TFDS names are downloaded into data_dir "
        "when not prepared there.",
        pattern=r"^([a-z][a-z0-9_]*(/[a-z0-9_.]+)?(:[0-9]+\.[0-9]+\.[0-9]+)?|folder:/[^\x00]+)$",
        title="Dataset",
    )
    data_dir: str | None = _field(
        None,
        "Data",
        "Where TFDS datasets (and prepared image folders) are read and prepared; empty: HETFLOW_HOME/data, "
        "shared by all runs. Elsewhere only under a root the machine's operator allows (HETFLOW_DATA_ROOTS).",
        pattern=r"^(/[^\x00]*)?$",
        title="Data directory",
    )
    image_size: str | None = _field(
        None,
        "Data",
        "dataset=folder:...: resize every image to HEIGHTxWIDTH (e.g. `28x28`); empty: the images' own size, "
        "which must then be the same for all.",
        pattern=r"^([1-9][0-9]{0,3}x[1-9][0-9]{0,3})?$",
        title="Image size (folder datasets)",
    )
    skip_unchanged: bool = _field(
        True,
        "Data",
        "Skip training and register nothing when a version of registered_model was already trained from this "
        "exact spec on data with the same fingerprint.",
        title="Skip when already trained",
    )
    model: Literal["mlp", "cnn", "convnet"] = _field(
        "mlp",
        "Model",
        "`mlp`: flatten, dense 128 relu, dense logits. `cnn`: two conv blocks and a dense head. "
        "`convnet`: the benchmark CNN (conv32-conv32-pool-conv64-conv64-pool-dense256), for 32x32 images.",
        title="Model",
    )
    strategy: Literal[STRATEGIES] = _field(
        "one_device",
        "Cluster",
        "`auto`: start sync workers that measure themselves before their first step, then choose equal or "
        "balanced batches, or relaunch as one_device or async (the decision and its numbers are logged). "
        "`one_device`: one replica, one device. `mirrored`: one replica, several devices, sync all-reduce. "
        "`multi_worker_mirrored`: several workers, sync all-reduce (worker 0 is chief). `parameter_server`: "
        "async updates; a chief coordinates workers, variables sharded over the ps. `model_parallel`: one "
        "replica, the model's layer groups placed on different devices.",
        title="Distribution strategy",
    )
    backend: Literal["local", "docker", "swarm", "kubernetes"] = _field(
        "local",
        "Cluster",
        "Where replicas run. `local`: subprocesses on 127.0.0.1. `docker`: one container per replica on a "
        "network of the run's own (needs a Docker engine). `swarm`: one Docker Swarm service per replica, "
        "spread over the swarm's nodes on an overlay network of the run's own (run from a manager node; "
        "HETFLOW_HOME on storage every node mounts at the same path). `kubernetes`: one pod per replica "
        "behind a headless service (needs a kubeconfig or an in-cluster service account).",
        title="Where replicas run",
    )
    workers: int = _field(
        1,
        "Cluster",
        "Training workers (several only with multi_worker_mirrored or parameter_server).",
        ge=1,
        le=16,
        title="Workers",
    )
    ps: int = _field(
        0, "Cluster", "Parameter servers (parameter_server needs at least one).", ge=0, le=8, title="Parameter servers"
    )
    devices_per_worker: int = _field(
        1,
        "Cluster",
        "Devices per worker: GPUs where there are, else logical CPU devices (mirrored, "
        "multi_worker_mirrored, model_parallel).",
        ge=1,
        le=8,
        title="Devices per worker",
    )
    worker_devices: list[WorkerDevice] = _field(
        [],
        "Cluster",
        "Per worker, for heterogeneous clusters: device kind, device count, threads and (simulation) slowdown, "
        'e.g. [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1, "slowdown": 2}]. Empty: '
        "every worker alike.",
        max_length=16,
        title="Per-worker devices",
    )
    balance_batches: bool = _field(
        False,
        "Cluster",
        "multi_worker_mirrored only: measure each worker's speed before the first step and give it "
        "a share of the global batch proportional to it; the loss is weighted so each update is still exactly "
        "the global-batch gradient.",
        title="Balance batches by worker speed",
    )
    replica_threads: int = _field(
        0,
        "Cluster",
        "TensorFlow intra- and inter-op threads per replica; 0 leaves TensorFlow's default.",
        ge=0,
        le=64,
        title="Threads per replica",
    )
    pin_cores: bool = _field(
        False,
        "Cluster",
        "Pin each replica to one CPU core (round robin), so replicas do not compete for cores.",
        title="Pin replicas to cores",
    )
    restart_policy: Literal["never", "on_failure", "exit_code"] = _field(
        "never",
        "Cluster",
        "`never`: a failed replica fails the run. `on_failure`: restart it, up to `backoff_limit` times: an "
        "async worker alone (the coordinator goes on), anything else with its whole group, resuming from the "
        "last checkpoint. `exit_code` (local, docker): restart only replicas killed by a signal, not ones that "
        "exited with an error a restart would repeat.",
        title="Restart failed replicas",
    )
    backoff_limit: int = _field(
        3,
        "Cluster",
        "Restarts allowed before a failure fails the run (restart_policy on_failure, exit_code).",
        ge=0,
        le=20,
        title="Restarts allowed",
    )
    train_timeout_seconds: int = _field(
        3600,
        "Cluster",
        "Training is stopped and fails after this many seconds (a hung replica, e.g. one waiting for a peer "
        "that never came up, would otherwise block the run forever).",
        ge=10,
        le=7 * 24 * 3600,
        title="Training time limit (seconds)",
    )
    image: str = _field(
        "hetflow-replica:0.1.0",
        "Cluster",
        "Replica image for the docker, swarm and kubernetes backends (built from docker/Dockerfile).",
        pattern=r"^[a-z0-9][a-z0-9._/:@-]{0,254}$",
        title="Replica image (docker, swarm, kubernetes)",
    )
    replica_cpus: float = _field(
        0.0,
        "Cluster",
        "CPU limit of each replica container, service or pod (docker, swarm, kubernetes); 0 = no limit.",
        ge=0,
        le=256,
        title="CPUs per replica (docker, swarm, kubernetes)",
    )
    replica_memory_mb: int = _field(
        0,
        "Cluster",
        "Memory limit of each replica container, service or pod in MiB (docker, swarm, kubernetes); 0 = no limit.",
        ge=0,
        le=4_194_304,
        title="Memory per replica, MiB (docker, swarm, kubernetes)",
    )
    request_gpus: bool = _field(
        False,
        "Cluster",
        "Request GPUs for the workers that compute on them (docker, swarm, kubernetes): each GPU worker of "
        "`worker_devices` its count, or, with `worker_devices` empty, every worker `devices_per_worker`; CPU "
        "workers, ps and a parameter_server chief get none.",
        title="Request GPUs (docker, swarm, kubernetes)",
    )
    encrypt_network: bool = _field(
        True,
        "Cluster",
        "backend=swarm: encrypt the run's overlay network between the nodes (IPsec; every node's kernel needs "
        "ESP). false: unencrypted VXLAN, only for nodes on a private network of their own.",
        title="Encrypt the swarm network (swarm)",
    )
    kubernetes_namespace: str = _field(
        "default",
        "Cluster",
        "Namespace of the run's pods and service (kubernetes).",
        pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
        title="Kubernetes namespace",
    )
    kubernetes_volume_claim: str = _field(
        "hetflow-home",
        "Cluster",
        "PersistentVolumeClaim (ReadWriteMany) holding HETFLOW_HOME, mounted in every pod at the same path "
        "(kubernetes).",
        pattern=r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$",
        title="Kubernetes volume claim",
    )
    epochs: int = _field(40, "Training", "Passes over the training split.", ge=1, le=1000, title="Epochs")
    steps_per_epoch: int | None = _field(
        None,
        "Training",
        "Steps per epoch; empty means one full pass over the training split.",
        ge=1,
        le=100_000,
        title="Steps per epoch",
    )
    batch_size: int = _field(
        32, "Training", "Global batch size, summed over all replicas.", ge=1, le=65_536, title="Batch size (global)"
    )
    learning_rate: float = _field(0.001, "Training", "Base learning rate.", gt=0, le=10, title="Learning rate")
    target_accuracy: float | None = _field(
        None,
        "Training",
        "Stop training at the end of the first epoch whose validation accuracy reaches this (the time to "
        "reach it is logged); empty trains all epochs.",
        gt=0,
        le=1,
        title="Stop at validation accuracy",
    )
    lr_scaling: Literal["none", "linear"] = _field(
        "none",
        "Training",
        "`linear`: the linear scaling rule (Goyal et al. 2017): the rate is learning_rate x batch_size / "
        "lr_reference_batch, reached after warmup_epochs. batch_size is the global batch (async: each "
        "update's), so adding replicas at the same batch_size leaves the rate unchanged.",
        title="Learning-rate scaling",
    )
    lr_reference_batch: int = _field(
        32,
        "Training",
        "The global batch size learning_rate was tuned for: the batch of the linear scaling rule's ratio "
        "(lr_scaling=linear).",
        ge=1,
        le=65_536,
        title="Reference batch size",
    )
    warmup_epochs: float = _field(
        0.0,
        "Training",
        "Epochs over which the learning rate ramps linearly up to its scaled value.",
        ge=0,
        le=100,
        title="Warm-up epochs",
    )
    optimizer: Literal["sgd", "adam"] = _field("adam", "Training", "Optimizer.", title="Optimizer")
    shuffle: bool = _field(True, "Training", "Shuffle training examples every epoch.", title="Shuffle")
    seed: int = _field(42, "Training", "Seed for weights, shuffling and ops.", ge=0, le=2**31 - 1, title="Random seed")
    checkpoint_every: int = _field(
        1,
        "Training",
        "Save a checkpoint every this many epochs (model, optimizer, epoch); a restarted or retried run "
        "resumes from the last one.",
        ge=1,
        le=1000,
        title="Checkpoint every (epochs)",
    )
    prune: bool = _field(
        True,
        "Compression",
        "Magnitude-prune the trained model (fine-tuned with a polynomial-decay schedule).",
        title="Prune",
    )
    target_sparsity: float = _field(
        0.5,
        "Compression",
        "Fraction of each kernel's weights set to zero by pruning.",
        ge=0,
        lt=1,
        title="Target sparsity",
    )
    fine_tuning_share: float = _field(
        0.75,
        "Compression",
        "Length of the pruning fine-tuning, as a share of the optimizer steps training took (at least 200 "
        "steps): sparsity ramps up over the first half, the second half recovers at target_sparsity.",
        gt=0,
        le=4,
        title="Pruning fine-tuning (share of training steps)",
    )
    quantize: Literal["none", "dynamic", "float16", "int8"] = _field(
        "int8",
        "Compression",
        "Quantization of the TFLite variants: `dynamic` (int8 weights), `float16`, `int8` (full integer, "
        "calibrated on the train split; where that loses more than max_accuracy_drop on the validation split, "
        "quantization-aware fine-tuning that keeps the pruned zeros), or `none`.",
        title="Quantization",
    )
    max_accuracy_drop: float = _field(
        0.01,
        "Export",
        "A compressed variant whose test accuracy is more than this below the float model's is rejected.",
        ge=0,
        le=1,
        title="Largest accuracy drop allowed",
    )
    export_formats: list[Literal["saved_model", "tflite"]] = _field(
        ["saved_model", "tflite"],
        "Export",
        "What export writes: a SavedModel (serving_default takes raw uint8 images) and/or TFLite variants.",
        min_length=1,
        title="Export formats",
    )
    registered_model: str = _field(
        "hetflow-digits",
        "Registry",
        "MLflow registered model name.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        title="Registered model",
    )
    min_improvement: float = _field(
        0.001,
        "Registry",
        "The new version becomes `champion` only if its test accuracy beats the champion's by at least this.",
        ge=0,
        le=1,
        title="Smallest improvement for champion",
    )

    @field_validator(*BACKEND_ONLY_KEYS, mode="before")
    @classmethod
    def _empty_takes_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value

    @property
    def replicas_in_sync(self) -> int:
        """Model replicas whose gradients are averaged into one update (1 for async and model parallel)."""
        if self.strategy in ("mirrored", "multi_worker_mirrored"):
            return self.workers * self.devices_per_worker
        return 1

    def worker_device(self, index: int) -> WorkerDevice:
        """Worker ``index``'s device settings: the one place every backend and the replica itself
        read a worker's device kind and count from (where worker_devices is empty: every worker
        alike, on ``devices_per_worker`` GPUs when ``request_gpus``, else CPUs)."""
        if self.worker_devices:
            return self.worker_devices[index]
        return WorkerDevice(device="gpu" if self.request_gpus else "cpu", count=self.devices_per_worker)


SPEC_KEYS: tuple[str, ...] = tuple(RunSpec.model_fields)


# Keys that only the container backends honour, with the value that leaves them off.
CONTAINER_ONLY_KEYS = {"replica_cpus": 0.0, "replica_memory_mb": 0, "request_gpus": False}


DATA_ROOTS_ENV = "HETFLOW_DATA_ROOTS"


def data_roots() -> list[str]:
    """Where a data_dir or a dataset folder may lie: HETFLOW_HOME/data and the folders the machine's
    operator lists in HETFLOW_DATA_ROOTS (``:``-separated), links resolved. Not a form field: a
    data_dir is shown to every replica, and one anywhere (the stack's secrets, /run and its Docker
    socket) would show them what they must not see; a folder's images become training data that the
    replicas read and the registered model was fitted to, so a folder anywhere would hand them any
    file the pipeline can read."""
    from hetflow.paths import data_dir

    listed = [root for root in os.environ.get(DATA_ROOTS_ENV, "").split(":") if root.startswith("/")]
    return [os.path.realpath(root) for root in [str(data_dir()), *listed]]


def _under_a_root(path: str, roots: list[str]) -> bool:
    resolved = os.path.realpath(path)
    return any(resolved == root or resolved.startswith(root.rstrip("/") + "/") for root in roots)


def data_location_problems(spec: RunSpec) -> list[str]:
    """data_dir and dataset=folder:PATH outside the allowed roots (``data_roots``), links resolved:
    checked when the spec is validated, and again by prepare_data right before it reads them."""
    problems = []
    if spec.data_dir and not _under_a_root(spec.data_dir, data_roots()):
        problems.append(
            f"data_dir={spec.data_dir} is invalid: expected empty or a folder under {', '.join(data_roots())} "
            f"(every replica is shown it; the machine's operator may allow more roots in {DATA_ROOTS_ENV})"
        )
    folder = spec.dataset.removeprefix("folder:") if spec.dataset.startswith("folder:") else None
    if folder and not _under_a_root(folder, data_roots()):
        problems.append(
            f"dataset={spec.dataset} is invalid: expected a TFDS name or folder:PATH with PATH under "
            f"{', '.join(data_roots())} (the machine's operator may allow more roots in {DATA_ROOTS_ENV})"
        )
    return problems


def cluster_problems(spec: RunSpec) -> list[str]:
    """Checks across keys: the cluster shape must fit the strategy, the batch the replicas."""
    problems = []
    if spec.workers > 1 and spec.strategy not in ("auto", "multi_worker_mirrored", "parameter_server"):
        problems.append(
            f"workers={spec.workers} is invalid with strategy={spec.strategy}: expected 1 "
            "(several workers need multi_worker_mirrored, parameter_server or auto)"
        )
    if spec.strategy == "parameter_server" and spec.ps < 1:
        problems.append("ps=0 is invalid with strategy=parameter_server: expected an integer >= 1 and <= 8")
    if spec.strategy not in ("parameter_server", "auto") and spec.ps > 0:
        problems.append(
            f"ps={spec.ps} is invalid with strategy={spec.strategy}: expected 0 "
            "(parameter servers serve only strategy=parameter_server; sync training all-reduces)"
        )
    if spec.strategy == "parameter_server" and not spec.shuffle:
        problems.append(
            "shuffle=false is invalid with strategy=parameter_server: expected true (async workers get "
            "distinct batches only by shuffling independently)"
        )
    if spec.quantize != "none" and "tflite" not in spec.export_formats:
        problems.append(
            f"quantize={spec.quantize} is invalid with export_formats={json.dumps(spec.export_formats)}: "
            'expected quantize=none, or "tflite" in export_formats (quantized variants are TFLite files)'
        )
    if spec.devices_per_worker > 1 and spec.strategy in ("one_device", "parameter_server"):
        problems.append(
            f"devices_per_worker={spec.devices_per_worker} is invalid with strategy={spec.strategy}: expected 1"
        )
    if spec.strategy == "model_parallel" and spec.devices_per_worker < 2:
        problems.append(
            f"devices_per_worker={spec.devices_per_worker} is invalid with strategy=model_parallel: "
            "expected 2 or more (one device per layer group)"
        )
    if spec.worker_devices and len(spec.worker_devices) != spec.workers:
        problems.append(
            f"worker_devices has {len(spec.worker_devices)} entries with workers={spec.workers}: "
            "expected one entry per worker, or none"
        )
    if spec.backend == "kubernetes" and any(d.slowdown != 1.0 for d in spec.worker_devices):
        problems.append(
            "worker_devices slowdown is invalid with backend=kubernetes: expected 1 "
            "(a slower machine is simulated by the local and docker backends only)"
        )
    if spec.balance_batches and (spec.strategy != "multi_worker_mirrored" or spec.devices_per_worker != 1):
        problems.append(
            f"balance_batches=true is invalid with strategy={spec.strategy}, devices_per_worker="
            f"{spec.devices_per_worker}: expected strategy=multi_worker_mirrored with devices_per_worker=1"
        )
    if spec.batch_size % spec.replicas_in_sync:
        problems.append(
            f"batch_size={spec.batch_size} is invalid with {spec.replicas_in_sync} replicas in sync: "
            f"expected a multiple of {spec.replicas_in_sync} (every replica gets an equal share)"
        )
    if spec.backend == "local":
        # Plain processes: nothing enforces a limit or requests a GPU.
        for key, off in CONTAINER_ONLY_KEYS.items():
            value = getattr(spec, key)
            if value != off:
                problems.append(
                    f"{key}={json.dumps(value)} is invalid with backend=local: expected {json.dumps(off)} "
                    "(limits and GPU requests apply to backend=docker, swarm or kubernetes)"
                )
    elif spec.backend == "kubernetes" and spec.restart_policy == "exit_code":
        problems.append("restart_policy=exit_code is invalid with backend=kubernetes: expected never or on_failure")
    if spec.image_size and not spec.dataset.startswith("folder:"):
        problems.append(
            f"image_size={spec.image_size} is invalid with dataset={spec.dataset}: expected empty "
            "(images are resized only for dataset=folder:PATH)"
        )
    problems += data_location_problems(spec)
    if spec.backend == "kubernetes" and (spec.data_dir or spec.dataset.startswith("folder:")):
        problems.append(
            "data_dir and dataset=folder:PATH are invalid with backend=kubernetes: expected data_dir empty and "
            "a TFDS dataset (pods see only the volume claim holding HETFLOW_HOME)"
        )
    if any(d.node for d in spec.worker_devices) and spec.backend != "swarm":
        problems.append(
            f"worker_devices node is invalid with backend={spec.backend}: expected empty "
            "(a worker is placed on a named node by backend=swarm only)"
        )
    if not spec.encrypt_network and spec.backend != "swarm":
        problems.append(
            f"encrypt_network=false is invalid with backend={spec.backend}: expected true "
            "(only backend=swarm's overlay network crosses machines)"
        )
    if spec.backend == "swarm" and spec.pin_cores:
        problems.append(
            "pin_cores=true is invalid with backend=swarm: expected false (Swarm services set CPUs by replica_cpus)"
        )
    if spec.backend == "kubernetes" and spec.pin_cores:
        problems.append(
            "pin_cores=true is invalid with backend=kubernetes: expected false (a pod's CPUs are set by replica_cpus)"
        )
    return problems


class SpecError(ValueError):
    """Invalid spec: one line per problem, each naming the key, the value and what is allowed."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@functools.cache
def _json_schema() -> dict[str, Any]:
    """RunSpec's JSON schema, built once: the DAG file reads it for every field at parse time."""
    return RunSpec.model_json_schema()


def _field_schema(key: str) -> dict[str, Any]:
    """The JSON schema of one key, flattened: `int | None` renders as anyOf [{integer, bounds},
    {null}], and a one-value Literal as `const`; the form and the messages want plain keywords."""
    schema = copy.deepcopy(_json_schema()["properties"][key])
    schema.pop("default", None)
    branches = schema.pop("anyOf", None)
    if branches:
        typed = [b for b in branches if b.get("type") != "null"]
        schema.update(typed[0])
        schema["nullable"] = len(typed) < len(branches)
    if "const" in schema:
        schema["enum"] = [schema.pop("const")]
    reference = schema.get("items", {}).get("$ref")
    if reference:  # a list of sub-models: the form needs the item schema inline
        schema["items"] = copy.deepcopy(_json_schema()["$defs"][reference.rsplit("/", 1)[1]])
    return schema


_TYPE_WORDS = {"integer": "an integer", "number": "a number", "boolean": "true or false", "string": "a string"}


def allowed_values(key: str) -> str:
    schema = _field_schema(key)
    if "enum" in schema:
        return "one of " + ", ".join(str(v) for v in schema["enum"])
    if schema.get("type") == "array" and "enum" in schema["items"]:
        items = schema["items"]["enum"]
        return f"a list of {schema.get('minItems', 0)} or more of " + ", ".join(items)
    if schema.get("type") == "array":
        return "a list of objects with keys " + ", ".join(schema["items"]["properties"])
    bounds = [
        f"{sign} {schema[bound]}"
        for bound, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))
        if bound in schema
    ]
    words = _TYPE_WORDS.get(schema.get("type", ""), "a value")
    if bounds:
        words += " " + " and ".join(bounds)
    if "pattern" in schema:
        words += f" matching {schema['pattern']}"
    if schema.get("nullable"):
        words += ", or empty"
    return words


def _problem_line(error: dict[str, Any]) -> str:
    key = str(error["loc"][0]) if error["loc"] else "spec"
    value = json.dumps(error.get("input"), default=str)
    if error["type"] == "extra_forbidden" and len(error["loc"]) > 2:
        index, field = error["loc"][1], error["loc"][2]
        return f"unknown key {key}[{index}].{field}; allowed keys: {', '.join(WorkerDevice.model_fields)}"
    if error["type"] == "extra_forbidden":
        guess = difflib.get_close_matches(key, SPEC_KEYS, n=1)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        return f"unknown key {key!r}={value}{hint}; allowed keys: {', '.join(SPEC_KEYS)}"
    if len(error["loc"]) > 2:  # a field of a list element (worker_devices[1].slowdown)
        index, field = error["loc"][1], ".".join(str(part) for part in error["loc"][2:])
        return f"{key}[{index}].{field}={value} is invalid: {error['msg'].lower()}"
    if key in RunSpec.model_fields:
        item = "".join(f"[{index}]" for index in error["loc"][1:])  # an element of a list
        return f"{key}{item}={value} is invalid: expected {allowed_values(key)}"
    return f"{value} is invalid: {error['msg']}"


def parse_spec(values: dict[str, Any]) -> RunSpec:
    """Validate ``values`` (missing keys take defaults); raise SpecError listing every problem."""
    try:
        spec = RunSpec.model_validate(values)
    except ValidationError as exc:
        raise SpecError([_problem_line(e) for e in exc.errors()]) from None
    problems = cluster_problems(spec)
    if problems:
        raise SpecError(problems)
    return spec


def parse_assignment(assignment: str) -> tuple[str, Any]:
    """``key=value`` from the command line; the value is read as JSON when it parses (3, 0.1, true, null)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise SpecError([f"--set {assignment!r} is invalid: expected KEY=VALUE"])
    try:
        return key.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw


def airflow_params() -> dict[str, Any]:
    """The DAG's ``Param``s (the trigger form), generated from the RunSpec schema."""
    from airflow.sdk import Param

    params = {}
    for key, field in RunSpec.model_fields.items():
        schema = _field_schema(key)
        json_type = schema.pop("type")
        description = schema.pop("description")
        if json_type in ("integer", "number"):
            description += f" Allowed: {allowed_values(key)}."
        if key in BACKEND_ONLY_KEYS:
            description += f" Empty: {json.dumps(field.default)}."
        if schema.pop("nullable", False) or key in BACKEND_ONLY_KEYS:
            json_type = [json_type, "null"]
        # The form's number input clamps what was typed into a top-level minimum/maximum when it
        # loses focus (-1 in Epochs silently became 1). Under allOf the bounds still refuse the
        # value at trigger time, and the description states them.
        bounds = {bound: schema.pop(bound) for bound in ("minimum", "maximum") if bound in schema}
        if bounds:
            schema["allOf"] = [bounds]
        # description_md (with no plain description) renders in the form as Markdown.
        params[key] = Param(field.default, type=json_type, description_md=description, **schema)
    return params

"""The cluster section: strategy, backend, a replica spec per replica type (worker, ps), the run
policy, the replicas' image and resources, and the settings of one backend each (swarm, kubernetes).
Laid out as Kubeflow's TFJob lays out its replica specs and run policy.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import ConfigDict, Field

from hetflow.cluster.backends import NAMES, backends_that, supports
from hetflow.spec.sections import Section, SpecModel, field_backends, short_name, spec_field

# No pipelining unless asked: it pays only where a stage's work grows with its examples. Three of
# wide_mlp's 4096-wide layers on one thread took 3.9x as long for 64 examples in 8 micro-batches as
# in one, each micro-batch materialising its own weight gradients; on a compute-bound MLP at batch
# 2048, 8 micro-batches made the step 1.51x faster (bench/PIPELINE_OVERLAP.md).
MICRO_BATCHES = 1
STAGE_SPLIT = "measured"
STRATEGIES = ("auto", "one_device", "mirrored", "multi_worker_mirrored", "parameter_server", "model_parallel")
CONTAINERS = tuple(backends_that(lambda s: s.limits_cpus_and_gpus))


class WorkerDevice(SpecModel):
    """One worker of a heterogeneous cluster."""

    device: Literal["cpu", "gpu"] = Field("cpu", description="Device kind the worker computes on.")
    count: int = Field(1, ge=1, le=8, description="Devices of that kind on the worker.")
    threads: int = Field(
        0,
        ge=0,
        le=64,
        description="TensorFlow intra/inter-op threads; 0 takes replica_threads. A replica a chief drives (a "
        "model_parallel stage, a ps, an async worker) runs two ops at once at least, so it can keep two cores "
        "busy: pin_cores holds it to one.",
    )
    slowdown: float = Field(
        1.0,
        ge=1.0,
        le=20.0,
        description="Simulates a slower machine: the worker gets 1/slowdown of the CPU time (local: its "
        "process is stopped and resumed from outside; docker, swarm: its container's or service's CPU quota "
        "is 1/slowdown of replica_cpus, or of one core). The training code is unchanged.",
    )
    node: str | None = Field(
        None,
        description="backend=swarm: the swarm node (its hostname) this worker runs on; empty: any node whose "
        "hetflow.device label is this worker's device, or any node where no node has that label.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
    )


class WorkerReplicas(Section):
    """The replica spec of the training workers."""

    replicas: int = spec_field(
        1,
        "Training workers (several only with multi_worker_mirrored, parameter_server, model_parallel or auto).",
        short="workers",
        ge=1,
        le=16,
        title="Workers",
    )
    devices: int = spec_field(
        1,
        "Devices per worker: GPUs where there are, else logical CPU devices (mirrored, "
        "multi_worker_mirrored, model_parallel).",
        short="devices_per_worker",
        ge=1,
        le=8,
        title="Devices per worker",
    )
    each: list[WorkerDevice] = spec_field(
        [],
        "Per worker, for heterogeneous clusters: device kind, device count, threads and (simulation) slowdown, "
        'e.g. [{"device": "cpu", "threads": 1}, {"device": "cpu", "threads": 1, "slowdown": 2}]. Empty: '
        "every worker alike.",
        short="worker_devices",
        max_length=16,
        title="Per-worker devices",
    )
    balance_batches: bool = spec_field(
        False,
        "multi_worker_mirrored only: measure each worker's speed before the first step and give it "
        "a share of the global batch proportional to it; the loss is weighted so each update is still exactly "
        "the global-batch gradient.",
        title="Balance batches by worker speed",
    )


class PsReplicas(Section):
    """The replica spec of the parameter servers."""

    replicas: int = spec_field(
        0, "Parameter servers (parameter_server needs at least one).", short="ps", ge=0, le=8, title="Parameter servers"
    )


class RunPolicy(Section):
    """What happens when a replica fails or training takes too long."""

    restart_policy: Literal["never", "on_failure", "exit_code"] = spec_field(
        "never",
        "`never`: a failed replica fails the run. `on_failure`: restart it, up to `backoff_limit` times: an "
        "async worker alone (the coordinator goes on), anything else with its whole group, resuming from the "
        "last checkpoint. `exit_code` (local, docker, swarm): restart only replicas killed by a signal, not ones that "
        "exited with an error a restart would repeat.",
        title="Restart failed replicas",
    )
    backoff_limit: int = spec_field(
        3,
        "Restarts allowed before a failure fails the run (restart_policy on_failure, exit_code).",
        ge=0,
        le=20,
        title="Restarts allowed",
    )
    timeout_seconds: int = spec_field(
        3600,
        "Training is stopped and fails after this many seconds (a hung replica, e.g. one waiting for a peer "
        "that never came up, would otherwise block the run forever).",
        short="train_timeout_seconds",
        ge=10,
        le=7 * 24 * 3600,
        title="Training time limit (seconds)",
    )


class Resources(Section):
    """Limits and GPU requests of every replica. The container-only ones (CPUs, GPUs) must keep their
    default (off) with backend=local; memory is limited there too."""

    cpus: float = spec_field(
        0.0,
        "CPU limit of each replica container, service or pod (docker, swarm, kubernetes); 0 = no limit.",
        short="replica_cpus",
        backends=CONTAINERS,
        ge=0,
        le=256,
        title="CPUs per replica (docker, swarm, kubernetes)",
    )
    memory_mb: int = spec_field(
        0,
        "Memory limit of each replica in MiB: its container's, service's or pod's; on local, a cgroup of its own "
        "where hetflow runs as root on cgroup v1 (elsewhere it is not enforced, and the replica's log says so); "
        "0 = no limit.",
        short="replica_memory_mb",
        ge=0,
        le=4_194_304,
        title="Memory per replica, MiB",
    )
    request_gpus: bool = spec_field(
        False,
        "Request GPUs for the workers that compute on them (docker, swarm, kubernetes): each GPU worker of "
        "`worker_devices` its count, or, with `worker_devices` empty, every worker `devices_per_worker`; CPU "
        "workers, ps and a parameter_server chief get none.",
        backends=CONTAINERS,
        title="Request GPUs (docker, swarm, kubernetes)",
    )

    def problems_without_limits(self, backend: str) -> list[str]:
        # Plain processes: nothing enforces a CPU limit or requests a GPU.
        return [
            f"{short_name(name, field)}={json.dumps(getattr(self, name))} is invalid with "
            f"backend={backend}: expected {json.dumps(field.default)} "
            f"(CPU limits and GPU requests apply to backend={_either(backends_that(lambda s: s.limits_cpus_and_gpus))})"
            for name, field in type(self).model_fields.items()
            if field_backends(field) and getattr(self, name) != field.default
        ]


class SwarmSettings(Section):
    encrypt_network: bool = spec_field(
        True,
        "backend=swarm: encrypt the run's overlay network between the nodes (IPsec; every node's kernel needs "
        "ESP). false: unencrypted VXLAN, only for nodes on a private network of their own.",
        backends=("swarm",),
        title="Encrypt the swarm network (swarm)",
    )


class KubernetesSettings(Section):
    namespace: str = spec_field(
        "default",
        "Namespace of the run's pods and service (kubernetes).",
        short="kubernetes_namespace",
        backends=("kubernetes",),
        pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
        title="Kubernetes namespace",
    )
    volume_claim: str = spec_field(
        "hetflow-home",
        "PersistentVolumeClaim (ReadWriteMany) holding HETFLOW_HOME, mounted in every pod at the same path "
        "(kubernetes).",
        short="kubernetes_volume_claim",
        backends=("kubernetes",),
        pattern=r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$",
        title="Kubernetes volume claim",
    )


class ClusterSpec(Section):
    model_config = ConfigDict(title="Cluster")

    strategy: Literal[STRATEGIES] = spec_field(
        "one_device",
        "`auto`: provisioning launches the workers to measure themselves, then starts them as one_device, "
        "sync with equal or balanced batches, or async, as measured (the decision and its numbers are logged). "
        "`one_device`: one replica, one device. `mirrored`: one replica, several devices, sync all-reduce. "
        "`multi_worker_mirrored`: several workers, sync all-reduce (worker 0 is chief). `parameter_server`: "
        "async updates; a chief coordinates workers, variables sharded over the ps. `model_parallel`: the "
        "model's consecutive layer groups on different workers (workers >= 2: a chief drives them, pipelined in "
        "micro_batches) or on one worker's devices (workers=1, devices_per_worker >= 2).",
        title="Distribution strategy",
    )
    backend: Literal[NAMES] = spec_field(
        "local",
        "Where replicas run. `local`: subprocesses on 127.0.0.1. `docker`: one container per replica on a "
        "network of the run's own (needs a Docker engine). `swarm`: one Docker Swarm service per replica, "
        "spread over the swarm's nodes on an overlay network of the run's own (run from a manager node; "
        "HETFLOW_HOME on storage every node mounts at the same path). `kubernetes`: one pod per replica "
        "behind a headless service (needs a kubeconfig or an in-cluster service account).",
        title="Where replicas run",
    )
    worker: WorkerReplicas = Field(default_factory=WorkerReplicas)
    micro_batches: int = spec_field(
        MICRO_BATCHES,
        "model_parallel only: each step's global batch is split into this many micro-batches, so that "
        "layer groups work at the same time (every micro-batch forward, then every one backward, one update "
        "from their summed gradients: the same update as the unsplit batch). 1, the default: no pipelining. "
        "It pays where a stage's work grows with its examples (a large batch: 8 made a step 1.51x faster, "
        "bench/PIPELINE_OVERLAP.md), not where each micro-batch's weight gradients dominate (a wide model at a "
        "small batch, where every micro-batch reads every weight again).",
        ge=1,
        le=64,
        title="Micro-batches (model_parallel)",
    )
    stage_split: Literal["measured", "parameters"] = spec_field(
        STAGE_SPLIT,
        "model_parallel only: where the model is cut into layer groups. `measured`: the chief times each "
        "layer and each stage's device before the first step and, among the cuts that give every stage some "
        "of the weights and (across workers) no stage more state than replica_memory_mb holds, cuts so that "
        "the slowest stage is fastest (unequal workers get unequal groups; the numbers are in plan.json). "
        "`parameters`: about equal parameter counts, whatever each layer costs and each worker's speed.",
        title="Layer groups split by (model_parallel)",
    )
    ps: PsReplicas = Field(default_factory=PsReplicas)
    replica_threads: int = spec_field(
        0,
        "TensorFlow intra- and inter-op threads per replica; 0 leaves TensorFlow's default.",
        ge=0,
        le=64,
        title="Threads per replica",
    )
    pin_cores: bool = spec_field(
        False,
        "Pin each replica to one CPU core (round robin), so replicas do not compete for cores.",
        title="Pin replicas to cores",
    )
    run_policy: RunPolicy = Field(default_factory=RunPolicy)
    image: str = spec_field(
        "hetflow-replica:0.1.0",
        "Replica image for the docker, swarm and kubernetes backends (built from docker/Dockerfile).",
        backends=CONTAINERS,
        pattern=r"^[a-z0-9][a-z0-9._/:@-]{0,254}$",
        title="Replica image (docker, swarm, kubernetes)",
    )
    resources: Resources = Field(default_factory=Resources)
    swarm: SwarmSettings = Field(default_factory=SwarmSettings)
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)

    @property
    def chief_coordinates(self) -> bool:
        """Whether a chief drives worker replicas that only serve: parameter_server's workers and
        ps, and model_parallel's stages when its layer groups span workers."""
        return self.strategy == "parameter_server" or (self.strategy == "model_parallel" and self.worker.replicas > 1)

    @property
    def stage_memory_mb(self) -> int:
        """The memory each model_parallel stage has to itself: replica_memory_mb where every stage is
        a worker replica of its own; 0 otherwise (no limit, or one replica's devices sharing it)."""
        return self.resources.memory_mb if self.strategy == "model_parallel" and self.worker.replicas > 1 else 0

    @property
    def replicas_in_sync(self) -> int:
        """Model replicas whose gradients are averaged into one update (1 for async and model parallel)."""
        if self.strategy in ("mirrored", "multi_worker_mirrored"):
            return self.worker.replicas * self.worker.devices
        return 1

    def worker_device(self, index: int) -> WorkerDevice:
        """Worker ``index``'s device settings: the one place every backend and the replica itself
        read a worker's device kind and count from (where worker_devices is empty: every worker
        alike, on ``devices_per_worker`` GPUs when ``request_gpus``, else CPUs)."""
        if self.worker.each:
            return self.worker.each[index]
        return WorkerDevice(device="gpu" if self.resources.request_gpus else "cpu", count=self.worker.devices)

    def problems(self) -> list[str]:
        """The cluster's shape must fit the strategy, and each setting the backend that reads it."""
        strategy, workers, ps = self.strategy, self.worker.replicas, self.ps.replicas
        devices, each = self.worker.devices, self.worker.each
        problems = []
        if workers > 1 and strategy not in ("auto", "multi_worker_mirrored", "parameter_server", "model_parallel"):
            problems.append(
                f"workers={workers} is invalid with strategy={strategy}: expected 1 "
                "(several workers need multi_worker_mirrored, parameter_server, model_parallel or auto)"
            )
        if strategy == "parameter_server" and ps < 1:
            problems.append("ps=0 is invalid with strategy=parameter_server: expected an integer >= 1 and <= 8")
        if strategy not in ("parameter_server", "auto") and ps > 0:
            problems.append(
                f"ps={ps} is invalid with strategy={strategy}: expected 0 "
                "(parameter servers serve only strategy=parameter_server; sync training all-reduces)"
            )
        if devices > 1 and strategy in ("one_device", "parameter_server"):
            problems.append(f"devices_per_worker={devices} is invalid with strategy={strategy}: expected 1")
        if strategy == "model_parallel" and workers == 1 and devices < 2:
            problems.append(
                f"devices_per_worker={devices} is invalid with strategy=model_parallel and workers=1: "
                "expected 2 or more (one device per layer group), or workers >= 2 (one layer group per worker)"
            )
        stage_devices = sorted({d.count for d in each} | {devices})
        if strategy == "model_parallel" and workers > 1 and stage_devices != [1]:
            problems.append(
                f"devices_per_worker={max(stage_devices)} is invalid with strategy=model_parallel and "
                f"workers={workers}: expected 1 (one layer group per worker; several devices serve workers=1)"
            )
        if strategy != "model_parallel" and self.stage_split != STAGE_SPLIT:
            problems.append(
                f"stage_split={self.stage_split} is invalid with strategy={strategy}: expected {STAGE_SPLIT}, "
                "the default (layer groups are model_parallel's only)"
            )
        if strategy != "model_parallel" and self.micro_batches != MICRO_BATCHES:
            problems.append(
                f"micro_batches={self.micro_batches} is invalid with strategy={strategy}: expected {MICRO_BATCHES}, "
                "the default (micro-batches pipeline model_parallel's layer groups only)"
            )
        if each and len(each) != workers:
            problems.append(
                f"worker_devices has {len(each)} entries with workers={workers}: expected one entry per worker, or none"
            )
        if any(d.slowdown != 1.0 for d in each) and not supports(self.backend).slows_workers:
            problems.append(
                f"worker_devices slowdown is invalid with backend={self.backend}: expected 1 "
                f"(a slower machine is simulated by backend={_either(backends_that(lambda s: s.slows_workers))} only)"
            )
        if self.worker.balance_batches and (strategy != "multi_worker_mirrored" or devices != 1):
            problems.append(
                f"balance_batches=true is invalid with strategy={strategy}, devices_per_worker="
                f"{devices}: expected strategy=multi_worker_mirrored with devices_per_worker=1"
            )
        return problems + self._backend_problems()

    def _backend_problems(self) -> list[str]:
        """What the chosen backend declares it cannot do (``hetflow.cluster.backends.<name>.SUPPORTS``)."""
        backend, can = self.backend, supports(self.backend)
        problems = [] if can.limits_cpus_and_gpus else self.resources.problems_without_limits(backend)
        if self.run_policy.restart_policy not in can.restart_policies:
            problems.append(
                f"restart_policy={self.run_policy.restart_policy} is invalid with backend={backend}: "
                f"expected {' or '.join(can.restart_policies)}"
            )
        if any(d.node for d in self.worker.each) and not can.places_on_named_nodes:
            problems.append(
                f"worker_devices node is invalid with backend={backend}: expected empty (a worker is placed on a "
                f"named node by backend={_either(backends_that(lambda s: s.places_on_named_nodes))} only)"
            )
        if not self.swarm.encrypt_network and not can.network_encryption_optional:
            problems.append(
                f"encrypt_network=false is invalid with backend={backend}: expected true (only "
                f"backend={_either(backends_that(lambda s: s.network_encryption_optional))}'s network crosses "
                "machines unencrypted on request)"
            )
        if self.pin_cores and can.pin_cores_refused:
            problems.append(
                f"pin_cores=true is invalid with backend={backend}: expected false ({can.pin_cores_refused})"
            )
        return problems


def _either(names: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)

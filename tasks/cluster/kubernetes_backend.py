"""Kubernetes backend: one pod per replica behind one headless service, all owned by the run.

The run is a ConfigMap (``hetflow-<run>``, holding the spec and the cluster layout); the service
and every pod carry an owner reference to it, so deleting that one object makes Kubernetes' garbage
collector delete everything of the run, whoever deletes it. Each pod sets ``hostname`` and
``subdomain`` (the headless service), which gives it the DNS name
``hetflow-<run>-worker-0.hetflow-<run>`` that its TF_CONFIG uses; the service publishes addresses
of pods that are not ready yet, since TensorFlow resolves its peers while they all start.

The manifests are built by pure functions (``run_configmap``, ``headless_service``,
``run_network_policy``, ``replica_pod``, ``tfjob_manifest``) and sent as they are;
``KubernetesReplicas`` only creates, inspects and deletes for the one supervisor
(``tasks.cluster.supervisor``); the kubelet restarts a failed container in its pod
(restartPolicy), and the supervisor counts those restarts. Every pod
mounts the PersistentVolumeClaim ``kubernetes_volume_claim`` at HETFLOW_HOME's path, so the run
directory is shared with the supervisor (which must mount it at the same path).

Pods meet the restricted Pod Security Standard (non-root numeric ids, no privilege escalation, no
capabilities, seccomp ``RuntimeDefault``) and get no service-account token: a replica runs code of
whoever filled in the trigger form and has no business with the API. The run's NetworkPolicy
admits ingress to its pods only from its own pods, on the gRPC port (TF's servers have no
authentication); it takes effect where the cluster's network plugin enforces NetworkPolicies.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import kubernetes.client
import kubernetes.config
import yaml
from kubernetes.client.exceptions import ApiException

from tasks.cluster.containers import (
    STOP_GRACE_SECONDS,
    lines_to_file,
    replica_cpus,
    replica_environment,
    replica_gpus,
)
from tasks.cluster.layout import SERVICE_PORT, ClusterLayout, Replica, plan_named_cluster, run_slug
from tasks.cluster.supervisor import ReplicaState
from tasks.paths import data_dir
from tasks.spec import RunSpec

log = logging.getLogger("hetflow.cluster")

LABEL_RUN = "hetflow.dev/run"  # the run's slug: what teardown selects on
LABEL_ROLE = "hetflow.dev/role"
LABEL_INDEX = "hetflow.dev/index"
ANNOTATION_RUN_ID = "hetflow.dev/run-id"  # the Airflow run id as it is (not a valid label value)
# The non-root user (and its group) of docker/Dockerfile: above the ids Debian gives system and
# login users, so a replica shares no id with a user of the node or of a mounted volume.
IMAGE_USER = 10001
# Waiting reasons after which a pod will never start by itself.
_STUCK_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError")
# Pods past train_timeout_seconds plus this are killed by the kubelet even if the supervisor
# died and teardown never ran (image pulls and scheduling come first).
_DEADLINE_MARGIN_SECONDS = 900


def run_name(run_id: str) -> str:
    """Name of the run's ConfigMap and headless service."""
    return f"hetflow-{run_slug(run_id)}"


def pod_name(run_id: str, replica_name: str) -> str:
    return f"{run_name(run_id)}-{replica_name}"


def replica_host(run_id: str, replica_name: str) -> str:
    """The pod's DNS name within its namespace: hostname.subdomain."""
    return f"{pod_name(run_id, replica_name)}.{run_name(run_id)}"


def plan(spec: RunSpec, run_id: str) -> ClusterLayout:
    return plan_named_cluster(spec, run_id, lambda name: replica_host(run_id, name))


def _run_labels(layout: ClusterLayout) -> dict:
    return {"app.kubernetes.io/name": "hetflow", LABEL_RUN: run_slug(layout.run_id)}


def _metadata(name: str, layout: ClusterLayout, namespace: str, labels: dict | None = None) -> dict:
    return {
        "name": name,
        "namespace": namespace,
        "labels": {**_run_labels(layout), **(labels or {})},
        "annotations": {ANNOTATION_RUN_ID: layout.run_id},
    }


def run_configmap(layout: ClusterLayout, spec: RunSpec, namespace: str) -> dict:
    """The object that stands for the run: everything else is owned by it."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(run_name(layout.run_id), layout, namespace),
        "data": {"spec.json": spec.model_dump_json(indent=2), "cluster.json": json.dumps(layout.to_dict(), indent=2)},
    }


def owner_reference(configmap_name: str, uid: str) -> dict:
    """Points at the run's ConfigMap; ``blockOwnerDeletion`` makes a foreground delete of the
    run wait until its pods are gone."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "name": configmap_name, "uid": uid, "blockOwnerDeletion": True}


def headless_service(layout: ClusterLayout, namespace: str, owner: dict) -> dict:
    metadata = _metadata(run_name(layout.run_id), layout, namespace)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {**metadata, "ownerReferences": [owner]},
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_RUN: run_slug(layout.run_id)},
            "publishNotReadyAddresses": True,
            "ports": [{"name": "grpc", "port": SERVICE_PORT, "targetPort": SERVICE_PORT}],
        },
    }


def run_network_policy(layout: ClusterLayout, namespace: str, owner: dict | None) -> dict:
    """Ingress to the run's pods only from the run's pods, on the gRPC port: TF's servers run graph
    ops for whoever reaches them. Selected by the run's label, like everything teardown deletes;
    ``owner`` is None in tfjob.yaml, where no run ConfigMap exists."""
    metadata = _metadata(run_name(layout.run_id), layout, namespace)
    run = run_slug(layout.run_id)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {**metadata, "ownerReferences": [owner]} if owner else metadata,
        "spec": {
            "podSelector": {"matchLabels": {LABEL_RUN: run}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": {LABEL_RUN: run}}}],
                    "ports": [{"protocol": "TCP", "port": SERVICE_PORT}],
                }
            ],
        },
    }


def _resources(spec: RunSpec, replica: Replica) -> dict:
    limits = {}
    cpus = replica_cpus(spec, replica)
    if cpus:
        limits["cpu"] = f"{round(cpus * 1000)}m"
    if spec.replica_memory_mb:
        limits["memory"] = f"{spec.replica_memory_mb}Mi"
    gpus = replica_gpus(spec, replica)
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    # Requests equal to limits: the replica gets what it asked for (Guaranteed QoS when both are set).
    return {"requests": dict(limits), "limits": limits} if limits else {}


def _container(spec: RunSpec, replica: Replica, run_dir: Path, env: dict[str, str], name: str) -> dict:
    container = {
        "name": name,
        "image": spec.image,
        "args": ["--run-dir", str(run_dir)],
        "env": [{"name": key, "value": value} for key, value in env.items()],
        "ports": [{"name": "grpc", "containerPort": SERVICE_PORT}],
        "volumeMounts": volume_mounts(run_dir),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    resources = _resources(spec, replica)
    if resources:
        container["resources"] = resources
    return container


def volume_mounts(run_dir: Path) -> list[dict]:
    """The run's own directory (read-write) and the prepared data (read-only), from the claim that
    holds HETFLOW_HOME, at the paths they have on the supervisor; nothing else of the claim: a
    replica cannot touch other runs, the stack's secrets or the dataset cache."""
    home = hetflow_home_of(run_dir)
    return [
        {"name": "hetflow-home", "mountPath": str(run_dir), "subPath": str(run_dir.relative_to(home))},
        {"name": "hetflow-home", "mountPath": str(data_dir(home)), "subPath": "data", "readOnly": True},
    ]


def hetflow_home_of(run_dir: Path) -> Path:
    """HETFLOW_HOME of a run directory (``<home>/runs/<run>``)."""
    return run_dir.parent.parent


def _pod_spec(spec: RunSpec, containers: list[dict], restart_policy: str) -> dict:
    return {
        "restartPolicy": restart_policy,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": IMAGE_USER,
            "runAsGroup": IMAGE_USER,
            "fsGroup": IMAGE_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,  # no service env vars for every service of the namespace
        "activeDeadlineSeconds": spec.train_timeout_seconds + _DEADLINE_MARGIN_SECONDS,
        "containers": containers,
        "volumes": [{"name": "hetflow-home", "persistentVolumeClaim": {"claimName": spec.kubernetes_volume_claim}}],
    }


def restart_policy(spec: RunSpec) -> str:
    return {"never": "Never", "on_failure": "OnFailure"}[spec.restart_policy]


def replica_pod(
    layout: ClusterLayout, replica: Replica, spec: RunSpec, run_dir: Path, owner: dict, launched_at: float
) -> dict:
    run_id = layout.run_id
    labels = {LABEL_ROLE: replica.role, LABEL_INDEX: str(replica.index)}
    env = replica_environment(layout, replica, hetflow_home_of(run_dir), launched_at)
    pod_spec = _pod_spec(spec, [_container(spec, replica, run_dir, env, "replica")], restart_policy(spec))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **_metadata(pod_name(run_id, replica.name), layout, spec.kubernetes_namespace, labels),
            "ownerReferences": [owner],
        },
        "spec": {
            **pod_spec,
            "hostname": pod_name(run_id, replica.name),
            "subdomain": run_name(run_id),
        },
    }


def tfjob_manifest(layout: ClusterLayout, spec: RunSpec, run_dir: Path) -> dict:
    """The same run as a Kubeflow TFJob (kubeflow.org/v1), for clusters that run the training
    operator: it sets TF_CONFIG itself (same roles, its own service names) and, with
    ``cleanPodPolicy: Running``, deletes the ps pods still running when the job ends."""
    kinds = {"chief": "Chief", "worker": "Worker", "ps": "PS"}
    replica_specs = {}
    for role, kind in kinds.items():
        replicas = [r for r in layout.replicas if r.role == role]
        if not replicas:
            continue
        env = replica_environment(layout, replicas[0], hetflow_home_of(run_dir), launched_at=0)
        del env["TF_CONFIG"], env["HETFLOW_LAUNCH_TIME"]  # the operator sets TF_CONFIG; no launch time is known
        # The operator requires the container to be named "tensorflow".
        container = _container(spec, replicas[0], run_dir, env, "tensorflow")
        replica_specs[kind] = {
            "replicas": len(replicas),
            "restartPolicy": restart_policy(spec),
            # The run's labels, so that the run's NetworkPolicy selects the operator's pods too.
            "template": {
                "metadata": {"labels": _run_labels(layout)},
                "spec": _pod_spec(spec, [container], restart_policy(spec)),
            },
        }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": _metadata(run_name(layout.run_id), layout, spec.kubernetes_namespace),
        "spec": {
            "runPolicy": {
                "cleanPodPolicy": "Running",
                "backoffLimit": spec.backoff_limit,
                "activeDeadlineSeconds": spec.train_timeout_seconds + _DEADLINE_MARGIN_SECONDS,
            },
            "tfReplicaSpecs": replica_specs,
        },
    }


def pod_state(pod) -> ReplicaState:
    """A pod's state, from the API's V1Pod: finished pods by phase, a restarting one by its
    container's last termination."""
    statuses = pod.status.container_statuses or []
    status = statuses[0] if statuses else None
    restarts = status.restart_count if status else 0
    if pod.status.phase == "Succeeded":
        return ReplicaState(0, restarts)
    terminated = status and (status.state.terminated or (status.state.waiting and status.last_state.terminated))
    if pod.status.phase == "Failed":
        # A pod killed before its container ran (evicted, past its deadline) has no exit code.
        return ReplicaState(terminated.exit_code if terminated else 1, restarts)
    waiting = status.state.waiting if status else None
    if waiting and waiting.reason in _STUCK_REASONS:
        return ReplicaState(None, restarts, f"{waiting.reason}: {waiting.message}")
    return ReplicaState(terminated.exit_code if terminated else None, restarts)


def load_client_config() -> None:
    """The kubeconfig of the user (or KUBECONFIG), or else the pod's service account when the
    supervisor itself runs in the cluster."""
    try:
        kubernetes.config.load_kube_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_incluster_config()


class KubernetesReplicas:
    """The kubernetes backend's side of the supervision (``supervisor.Replicas``): creates,
    inspects and deletes the pods of one run."""

    restarts_in_place = True

    def __init__(self, layout: ClusterLayout, spec: RunSpec, run_dir: Path, core=None, networking=None):
        self.layout = layout
        self.spec = spec
        self.namespace = spec.kubernetes_namespace
        self.run_dir = run_dir
        self.logs_dir = run_dir / "logs"
        if core is None:
            load_client_config()
        self.core = core or kubernetes.client.CoreV1Api()
        self.networking = networking or kubernetes.client.NetworkingV1Api()
        self._owner = None

    def provision(self) -> None:
        """The run's ConfigMap, its NetworkPolicy, its headless service and every replica's pod."""
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        # For clusters with the training operator: the same run, to `kubectl apply` instead.
        (self.run_dir / "tfjob.yaml").write_text(
            yaml.safe_dump_all(
                [
                    tfjob_manifest(self.layout, self.spec, self.run_dir),
                    run_network_policy(self.layout, self.namespace, None),
                ]
            )
        )
        run = self.core.create_namespaced_config_map(
            self.namespace, run_configmap(self.layout, self.spec, self.namespace)
        )
        self._owner = owner_reference(run.metadata.name, run.metadata.uid)
        # Before any pod, so that no pod is ever reachable from outside the run.
        self.networking.create_namespaced_network_policy(
            self.namespace, run_network_policy(self.layout, self.namespace, self._owner)
        )
        self.core.create_namespaced_service(self.namespace, headless_service(self.layout, self.namespace, self._owner))
        self.start(self.layout.replicas)

    def start(self, replicas) -> None:
        launched_at = time.time()
        for replica in replicas:
            pod = replica_pod(self.layout, replica, self.spec, self.run_dir, self._owner, launched_at)
            self.core.create_namespaced_pod(self.namespace, pod)
            log.info("created %s (pod %s) at %s", replica.name, pod["metadata"]["name"], replica.address)

    def lines(self, name: str, since: float):
        """Follow the pod's log once its container has started (the API refuses before)."""
        pod = pod_name(self.layout.run_id, name)
        while True:
            try:
                phase = self.core.read_namespaced_pod(pod, self.namespace).status.phase
            except ApiException:  # deleted before it ever started
                return
            if phase != "Pending":
                break
            time.sleep(1)
        try:
            stream = self.core.read_namespaced_pod_log(pod, self.namespace, follow=True, _preload_content=False)
            yield from lines_to_file(stream.stream(), self.logs_dir / f"{name}.log")
        except ApiException:  # deleted while streaming: its output is in the file
            return

    def attach(self) -> None:
        """Pods do not depend on their supervisor: teardown and their activeDeadlineSeconds end them."""

    def detach(self) -> None:
        pass

    def poll(self) -> dict[str, ReplicaState]:
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{LABEL_RUN}={run_slug(self.layout.run_id)}"
        )
        by_name = {f"{p.metadata.labels[LABEL_ROLE]}-{p.metadata.labels[LABEL_INDEX]}": p for p in pods.items}
        # A pod deleted by someone else is gone with its exit code: count it as failed.
        return {
            r.name: pod_state(by_name[r.name]) if r.name in by_name else ReplicaState(-1) for r in self.layout.replicas
        }

    def stop(self, names) -> None:
        for name in names:
            try:
                self.core.delete_namespaced_pod(
                    pod_name(self.layout.run_id, name), self.namespace, grace_period_seconds=STOP_GRACE_SECONDS
                )
            except ApiException as error:
                if error.status != 404:
                    raise


def teardown_run(run_id: str, namespace: str, core=None, networking=None) -> list[str]:
    """Delete the run's ConfigMap (the garbage collector deletes what it owns) and, for what an
    interrupted start left without an owner, every pod, service and NetworkPolicy with the run's
    label. Returns the names deleted."""
    if core is None:
        load_client_config()
        core = kubernetes.client.CoreV1Api()
    networking = networking or kubernetes.client.NetworkingV1Api()
    selector = f"{LABEL_RUN}={run_slug(run_id)}"
    deleted = []
    for kind, listing, delete in (
        ("pod", core.list_namespaced_pod, core.delete_namespaced_pod),
        ("service", core.list_namespaced_service, core.delete_namespaced_service),
        (
            "networkpolicy",
            networking.list_namespaced_network_policy,
            networking.delete_namespaced_network_policy,
        ),
        ("configmap", core.list_namespaced_config_map, core.delete_namespaced_config_map),
    ):
        for item in listing(namespace, label_selector=selector).items:
            try:
                delete(item.metadata.name, namespace, grace_period_seconds=STOP_GRACE_SECONDS)
                deleted.append(f"{kind}/{item.metadata.name}")
            except ApiException as error:
                if error.status != 404:
                    raise
    return deleted

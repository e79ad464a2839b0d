"""The Kubernetes manifests of a run, built by pure functions and sent as they are: the run's
ConfigMap (``hetflow-<run>``, holding the spec and the cluster layout), which owns everything else;
the headless service that gives each pod the DNS name its TF_CONFIG uses; the NetworkPolicy that
admits only the run's own pods on the gRPC port; one pod per replica; and the same run as a
Kubeflow TFJob for clusters that run the training operator.

Pods meet the restricted Pod Security Standard (non-root numeric ids, no privilege escalation, no
capabilities, seccomp ``RuntimeDefault``), get a read-only root file system with a private /tmp (an
``emptyDir``), as docker containers do, and no service-account token: a replica runs code of
whoever filled in the trigger form and has no business with the API. A pod's process count cannot be
bounded in its manifest: that is the kubelet's ``podPidsLimit`` (KubeletConfiguration), the
operator's to set. Every pod mounts only the run's
directory (read-only), its output folder in it (read-write, as the docker backend binds it) and the
prepared data (read-only) from the PersistentVolumeClaim ``kubernetes_volume_claim`` that holds
HETFLOW_HOME, and sets no ``fsGroup``, so the kubelet changes no owner or mode on the claim: the
supervisor has made the output folder the pods' uid's, and the rest is readable by all.
"""

from __future__ import annotations

import json
from pathlib import Path

from hetflow.cluster.containers import TMP_BYTES, replica_environment, replica_spec
from hetflow.cluster.layout import SERVICE_PORT, ClusterLayout, Replica, run_slug
from hetflow.data.prepare import shown_to_replicas
from hetflow.paths import RunPaths, data_dir
from hetflow.spec import RunSpec

LABEL_RUN = "hetflow.dev/run"  # the run's slug: what teardown selects on
LABEL_ROLE = "hetflow.dev/role"
LABEL_INDEX = "hetflow.dev/index"
ANNOTATION_RUN_ID = "hetflow.dev/run-id"  # the Airflow run id as it is (not a valid label value)
# On the run's ConfigMap: where its supervisor's lease is, how `hetflow sweep` tells a live run.
ANNOTATION_RUN_DIR = "hetflow.dev/run-dir"
# The non-root user (and its group) of docker/Dockerfile: above the ids Debian gives system and
# login users, so a replica shares no id with a user of the node or of a mounted volume.
IMAGE_USER = 10001
# Pods past train_timeout_seconds plus this are killed by the kubelet even if the supervisor
# died and teardown never ran (image pulls and scheduling come first).
DEADLINE_MARGIN_SECONDS = 900

# The pod's /tmp (containers.TMP_BYTES), an emptyDir: its root file system is read-only.
TMP_VOLUME = "tmp"

# A finished TFJob stays this long for its pods' logs to be read, then the operator deletes it.
FINISHED_JOB_TTL_SECONDS = 3600


def run_name(run_id: str) -> str:
    """Name of the run's ConfigMap and headless service."""
    return f"hetflow-{run_slug(run_id)}"


def pod_name(run_id: str, replica_name: str) -> str:
    return f"{run_name(run_id)}-{replica_name}"


def replica_host(run_id: str, replica_name: str) -> str:
    """The pod's DNS name within its namespace: hostname.subdomain."""
    return f"{pod_name(run_id, replica_name)}.{run_name(run_id)}"


def _run_labels(layout: ClusterLayout) -> dict:
    return {"app.kubernetes.io/name": "hetflow", LABEL_RUN: run_slug(layout.run_id)}


def _metadata(name: str, layout: ClusterLayout, namespace: str, labels: dict | None = None) -> dict:
    return {
        "name": name,
        "namespace": namespace,
        "labels": {**_run_labels(layout), **(labels or {})},
        "annotations": {ANNOTATION_RUN_ID: layout.run_id},
    }


def run_configmap(layout: ClusterLayout, spec: RunSpec, namespace: str, run_dir: Path) -> dict:
    """The object that stands for the run: everything else is owned by it."""
    metadata = _metadata(run_name(layout.run_id), layout, namespace)
    metadata["annotations"][ANNOTATION_RUN_DIR] = str(run_dir)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata,
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
    ops for whoever reaches them; egress only to the run's pods on that port and to the cluster's
    DNS (a replica needs nothing else: not the API server, not a cloud metadata endpoint). Selected
    by the run's label, like everything teardown deletes; ``owner`` is None in tfjob.yaml, where no
    run ConfigMap exists."""
    metadata = _metadata(run_name(layout.run_id), layout, namespace)
    run = run_slug(layout.run_id)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {**metadata, "ownerReferences": [owner]} if owner else metadata,
        "spec": {
            "podSelector": {"matchLabels": {LABEL_RUN: run}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": {LABEL_RUN: run}}}],
                    "ports": [{"protocol": "TCP", "port": SERVICE_PORT}],
                }
            ],
            "egress": [
                {
                    "to": [{"podSelector": {"matchLabels": {LABEL_RUN: run}}}],
                    "ports": [{"protocol": "TCP", "port": SERVICE_PORT}],
                },
                {
                    "to": [
                        {
                            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                        }
                    ],
                    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                },
            ],
        },
    }


def _resources(spec: RunSpec, replica: Replica) -> dict:
    limits = {}
    needs = replica_spec(spec, replica)
    cpus = needs.cpus
    if cpus:
        limits["cpu"] = f"{round(cpus * 1000)}m"
    if needs.memory_mb:
        limits["memory"] = f"{needs.memory_mb}Mi"
    gpus = needs.gpus
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    # Requests equal to limits: the replica gets what it asked for (Guaranteed QoS when both are set).
    return {"requests": dict(limits), "limits": limits} if limits else {}


def container_security_context() -> dict:
    """As a docker container's: nothing of the image is writable, so a replica cannot plant code
    that the image runs (its venv, its hetflow package) for whoever runs next in the pod; no
    capability, no privilege escalation. Also the serving pods' (``hetflow.serving.kserve``)."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
    }


def pod_security_context() -> dict:
    """The restricted Pod Security Standard's pod-level part: numeric non-root ids (the kubelet can
    only verify runAsNonRoot for a numeric user) and the runtime's default seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": IMAGE_USER,
        "runAsGroup": IMAGE_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def tmp_volume() -> dict:
    """The pod's /tmp (containers.TMP_BYTES), an emptyDir: its root file system is read-only."""
    return {"name": TMP_VOLUME, "emptyDir": {"sizeLimit": f"{TMP_BYTES // 2**20}Mi"}}


def _container(spec: RunSpec, replica: Replica, run_dir: Path, env: dict[str, str], name: str) -> dict:
    container = {
        "name": name,
        "image": replica_spec(spec, replica).image,
        "args": ["--run-dir", str(run_dir)],
        "env": [{"name": key, "value": value} for key, value in {**env, "HOME": "/tmp"}.items()],
        "ports": [{"name": "grpc", "containerPort": SERVICE_PORT}],
        "volumeMounts": [*volume_mounts(run_dir), {"name": TMP_VOLUME, "mountPath": "/tmp"}],
        "securityContext": container_security_context(),
    }
    resources = _resources(spec, replica)
    if resources:
        container["resources"] = resources
    return container


def volume_mounts(run_dir: Path) -> list[dict]:
    """The run's own directory (read-only as a whole), its output folder (``RunPaths.output``, the one
    the pods write and own) and the run's prepared dataset (read-only: its version folder alone), from
    the claim that holds HETFLOW_HOME, at the paths they have on the supervisor; nothing else of the
    claim: a replica cannot touch other runs, the stack's secrets, other datasets or the dataset cache,
    nor any record of the pipeline's, including those it renames into the run directory later."""
    home = hetflow_home_of(run_dir)
    read_only = [
        {"name": "hetflow-home", "mountPath": str(path), "subPath": str(path.relative_to(home)), "readOnly": True}
        for path in [run_dir, *shown_to_replicas(run_dir, data_dir(home))]
    ]
    output = RunPaths(run_dir).output
    return [*read_only, {"name": "hetflow-home", "mountPath": str(output), "subPath": str(output.relative_to(home))}]


def hetflow_home_of(run_dir: Path) -> Path:
    """HETFLOW_HOME of a run directory (``<home>/runs/<run>``)."""
    return run_dir.parent.parent


def _pod_spec(spec: RunSpec, containers: list[dict], restart_policy: str) -> dict:
    return {
        "restartPolicy": restart_policy,
        # No fsGroup: the kubelet would give the whole volume, not the mounted sub-paths, to that
        # group, group-writable (every run, the stack's secrets, MLflow's files), and
        # fsGroupChangePolicy OnRootMismatch only skips that when the claim's root already matches.
        # The supervisor makes the output folder IMAGE_USER's instead (hand_over_to_pods).
        "securityContext": pod_security_context(),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,  # no service env vars for every service of the namespace
        "activeDeadlineSeconds": spec.cluster.run_policy.timeout_seconds + DEADLINE_MARGIN_SECONDS,
        "containers": containers,
        "volumes": [
            {"name": "hetflow-home", "persistentVolumeClaim": {"claimName": spec.cluster.kubernetes.volume_claim}},
            tmp_volume(),
        ],
    }


def restart_policy(spec: RunSpec) -> str:
    return {"never": "Never", "on_failure": "OnFailure"}[spec.cluster.run_policy.restart_policy]


def replica_pod(
    layout: ClusterLayout,
    replica: Replica,
    spec: RunSpec,
    run_dir: Path,
    owner: dict,
    launched_at: float,
) -> dict:
    run_id = layout.run_id
    labels = {LABEL_ROLE: replica.role, LABEL_INDEX: str(replica.index)}
    env = replica_environment(layout, replica, hetflow_home_of(run_dir), launched_at)
    container = _container(spec, replica, run_dir, env, "replica")
    pod_spec = _pod_spec(spec, [container], restart_policy(spec))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **_metadata(pod_name(run_id, replica.name), layout, spec.cluster.kubernetes.namespace, labels),
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
    ``cleanPodPolicy: Running``, deletes the ps pods still running when the job ends. Its pods
    mount what ``replica_pod``'s do (``volume_mounts``)."""
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
        "metadata": _metadata(run_name(layout.run_id), layout, spec.cluster.kubernetes.namespace),
        "spec": {
            "runPolicy": {
                "cleanPodPolicy": "Running",
                "backoffLimit": spec.cluster.run_policy.backoff_limit,
                "activeDeadlineSeconds": spec.cluster.run_policy.timeout_seconds + DEADLINE_MARGIN_SECONDS,
                # The finished job and its pods (their logs) are deleted after this long.
                "ttlSecondsAfterFinished": FINISHED_JOB_TTL_SECONDS,
            },
            "tfReplicaSpecs": replica_specs,
        },
    }

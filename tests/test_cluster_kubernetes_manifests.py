"""The kubernetes backend's manifests (hetflow/cluster/backends/kubernetes/manifests.py): the headless service,
the pods, the ConfigMap, the TFJob against the training operator's own CRD, the run's network
policy; pod states (hetflow/cluster/backends/kubernetes/backend.py); and a real run where a cluster exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cluster_run import HOME, OWNER, RUN_DIR, RUN_ID, ps_spec
from crd_schema import crd_validator, errors
from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateRunning,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1Pod,
    V1PodStatus,
)

from hetflow.cluster.backends.base import ReplicaState
from hetflow.cluster.backends.kubernetes import backend as k8s
from hetflow.cluster.backends.kubernetes import manifests as manifests
from hetflow.cluster.layout import run_slug
from hetflow.spec import parse_spec

BIN = Path(sys.executable).parent


# --- kubernetes: manifests ------------------------------------------------------------------------


def _manifests(spec):
    layout = k8s.plan(spec, RUN_ID)
    pods = {r.name: manifests.replica_pod(layout, r, spec, RUN_DIR, OWNER, 12.5) for r in layout.replicas}
    return layout, manifests.headless_service(layout, spec.cluster.kubernetes.namespace, OWNER), pods


def test_kubernetes_service_is_headless_and_selects_every_pod_of_the_run():
    spec = ps_spec("kubernetes", kubernetes_namespace="ml")
    layout, service, pods = _manifests(spec)
    assert service["metadata"]["name"] == manifests.run_name(RUN_ID)
    assert service["metadata"]["namespace"] == "ml"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True  # peers resolve each other while starting
    assert service["spec"]["ports"] == [{"name": "grpc", "port": 2222, "targetPort": 2222}]
    for pod in pods.values():
        labels = pod["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
    assert service["metadata"]["ownerReferences"] == [OWNER]


def test_kubernetes_pods_resolve_as_their_tf_config_addresses_and_are_owned_by_the_run():
    spec = ps_spec("kubernetes", replica_cpus=2, replica_memory_mb=4096, request_gpus=True, kubernetes_namespace="ml")
    layout, service, pods = _manifests(spec)
    for replica in layout.replicas:
        pod = pods[replica.name]
        # hostname.subdomain is the pod's DNS name under a headless service of that name
        assert f"{pod['spec']['hostname']}.{pod['spec']['subdomain']}:2222" == replica.address
        assert pod["spec"]["subdomain"] == service["metadata"]["name"]
        assert pod["metadata"]["ownerReferences"] == [OWNER]
        assert pod["metadata"]["labels"]["hetflow.dev/role"] == replica.role
        assert pod["metadata"]["labels"]["hetflow.dev/index"] == str(replica.index)
        assert pod["metadata"]["annotations"] == {"hetflow.dev/run-id": RUN_ID}
        assert pod["spec"]["restartPolicy"] == "Never"
        assert pod["spec"]["activeDeadlineSeconds"] > spec.cluster.run_policy.timeout_seconds
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["TF_CONFIG"] == layout.tf_config(replica)
        assert env["HETFLOW_RUN_ID"] == RUN_ID and env["HETFLOW_HOME"] == str(HOME)
        assert container["args"] == ["--run-dir", str(RUN_DIR)]
        assert container["ports"] == [{"name": "grpc", "containerPort": 2222}]
        # Its own run directory read-only, and only its output folder writable (a run without a prepared
        # dataset here: its data, read-only too, in test_security_data_view); not the rest of HETFLOW_HOME.
        output = RUN_DIR / "replica_output"
        assert container["volumeMounts"] == [
            {"name": "hetflow-home", "mountPath": str(RUN_DIR), "subPath": f"runs/{RUN_DIR.name}", "readOnly": True},
            {"name": "hetflow-home", "mountPath": str(output), "subPath": f"runs/{RUN_DIR.name}/replica_output"},
            {"name": "tmp", "mountPath": "/tmp"},
        ]
        assert pod["spec"]["volumes"] == [
            {"name": "hetflow-home", "persistentVolumeClaim": {"claimName": "hetflow-home"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "512Mi"}},
        ]
        gpus = {"nvidia.com/gpu": "1"} if replica.role == "worker" else {}
        assert container["resources"]["limits"] == {"cpu": "2000m", "memory": "4096Mi", **gpus}
        assert container["resources"]["requests"] == container["resources"]["limits"]


def test_kubernetes_restart_policy_is_mapped_from_the_spec():
    for policy, expected in (("never", "Never"), ("on_failure", "OnFailure")):
        _, _, pods = _manifests(ps_spec("kubernetes", restart_policy=policy))
        assert {pod["spec"]["restartPolicy"] for pod in pods.values()} == {expected}


def test_kubernetes_manifests_pass_strict_schema_validation(tmp_path):
    spec = ps_spec("kubernetes", replica_cpus=0.5, replica_memory_mb=1024, request_gpus=True)
    layout, service, pods = _manifests(spec)
    policy = manifests.run_network_policy(layout, "default", OWNER)
    # The TFJob's pod templates, as the pods the operator makes of them.
    templates = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": kind.lower(), **r["template"]["metadata"]},
            "spec": r["template"]["spec"],
        }
        for kind, r in manifests.tfjob_manifest(layout, spec, RUN_DIR)["spec"]["tfReplicaSpecs"].items()
    ]
    documents = [manifests.run_configmap(layout, spec, "default", RUN_DIR), service, policy, *pods.values(), *templates]
    manifest = tmp_path / "run.yaml"
    manifest.write_text(yaml.safe_dump_all(documents))
    result = subprocess.run([BIN / "kubernetes-validate", "--strict", manifest], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # and the check bites: a misspelt field fails it
    pods["ps-0"]["spec"]["restartPolicyy"] = "Never"
    manifest.write_text(yaml.safe_dump(pods["ps-0"]))
    result = subprocess.run([BIN / "kubernetes-validate", "--strict", manifest], capture_output=True, text=True)
    assert result.returncode != 0 and "restartPolicyy" in result.stdout + result.stderr


def test_kubernetes_run_configmap_holds_the_spec_and_layout():
    spec = ps_spec("kubernetes")
    layout = k8s.plan(spec, RUN_ID)
    configmap = manifests.run_configmap(layout, spec, "default", RUN_DIR)
    assert configmap["metadata"]["name"] == OWNER["name"] == manifests.run_name(RUN_ID)
    assert json.loads(configmap["data"]["cluster.json"]) == layout.to_dict()
    assert json.loads(configmap["data"]["spec.json"]) == spec.model_dump()
    assert OWNER["blockOwnerDeletion"] is True and OWNER["kind"] == "ConfigMap"


def test_tfjob_manifest_has_the_same_replicas_and_cleans_up_running_ps():
    spec = ps_spec("kubernetes", restart_policy="on_failure", backoff_limit=5)
    tfjob = manifests.tfjob_manifest(k8s.plan(spec, RUN_ID), spec, RUN_DIR)
    assert (tfjob["apiVersion"], tfjob["kind"]) == ("kubeflow.org/v1", "TFJob")
    replicas = tfjob["spec"]["tfReplicaSpecs"]
    assert {kind: r["replicas"] for kind, r in replicas.items()} == {"Chief": 1, "Worker": 2, "PS": 1}
    assert {r["restartPolicy"] for r in replicas.values()} == {"OnFailure"}
    assert tfjob["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    assert tfjob["spec"]["runPolicy"]["backoffLimit"] == 5
    for replica in replicas.values():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow"  # the operator looks for this name
        names = {e["name"] for e in container["env"]}
        assert "TF_CONFIG" not in names and "HETFLOW_RUN_ID" in names  # the operator sets TF_CONFIG
    sync = parse_spec({"backend": "kubernetes", "strategy": "multi_worker_mirrored", "workers": 2})
    assert list(manifests.tfjob_manifest(k8s.plan(sync, RUN_ID), sync, RUN_DIR)["spec"]["tfReplicaSpecs"]) == ["Worker"]


@pytest.mark.parametrize("shape", ["sync", "async"])
def test_the_tfjob_is_valid_against_the_training_operators_own_crd_schema(shape):
    validator = crd_validator("kubeflow.org_tfjobs.yaml", "v1")  # schemas/README.md: its source
    if shape == "sync":
        spec = parse_spec({"backend": "kubernetes", "strategy": "multi_worker_mirrored", "workers": 2})
    else:
        spec = ps_spec("kubernetes", restart_policy="on_failure", replica_cpus=2, replica_memory_mb=4096)
    tfjob = manifests.tfjob_manifest(k8s.plan(spec, RUN_ID), spec, RUN_DIR)
    assert errors(validator, tfjob) == []
    run_policy = tfjob["spec"]["runPolicy"]
    assert set(run_policy) == {"cleanPodPolicy", "backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished"}
    # The check can fail: a field the CRD does not have, or a value of the wrong type, is reported.
    tfjob["spec"]["runPolicy"]["cleanupPodPolicy"] = "All"
    tfjob["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] = "two"
    assert len(list(validator.iter_errors(tfjob))) == 2


def test_the_run_network_policy_limits_egress_to_the_run_and_dns():
    spec = ps_spec("kubernetes")
    policy = manifests.run_network_policy(k8s.plan(spec, RUN_ID), "ml", None)["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    run = {"matchLabels": {manifests.LABEL_RUN: run_slug(RUN_ID)}}
    to_run, to_dns = policy["egress"]
    assert to_run == {"to": [{"podSelector": run}], "ports": [{"protocol": "TCP", "port": 2222}]}
    assert to_dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert {p["port"] for p in to_dns["ports"]} == {53}
    assert not any("ipBlock" in peer for rule in policy["egress"] for peer in rule["to"])  # no address outside


def _pod(phase, state=None, last=None, restarts=0):
    status = V1ContainerStatus(
        name="replica",
        image="i",
        image_id="",
        ready=False,
        restart_count=restarts,
        state=state or V1ContainerState(),
        last_state=last or V1ContainerState(),
    )
    return V1Pod(status=V1PodStatus(phase=phase, container_statuses=[status]))


def test_kubernetes_pod_states():
    terminated = V1ContainerState(terminated=V1ContainerStateTerminated(exit_code=3))
    running = V1ContainerState(running=V1ContainerStateRunning())
    assert k8s.pod_state(V1Pod(status=V1PodStatus(phase="Pending"))) == ReplicaState()
    assert k8s.pod_state(_pod("Running", running)) == ReplicaState()
    assert k8s.pod_state(_pod("Succeeded", V1ContainerState(terminated=V1ContainerStateTerminated(exit_code=0)))) == (
        ReplicaState(0)
    )
    assert k8s.pod_state(_pod("Failed", terminated)) == ReplicaState(3)
    assert k8s.pod_state(V1Pod(status=V1PodStatus(phase="Failed"))) == ReplicaState(1)  # evicted: no exit code
    crash_loop = V1ContainerState(waiting=V1ContainerStateWaiting(reason="CrashLoopBackOff"))
    assert k8s.pod_state(_pod("Running", crash_loop, terminated, restarts=2)) == ReplicaState(3, 2)
    pull = V1ContainerState(waiting=V1ContainerStateWaiting(reason="ImagePullBackOff", message="no such image"))
    assert k8s.pod_state(_pod("Pending", pull)) == ReplicaState(None, 0, "ImagePullBackOff: no such image")


# --- real runs, where an engine or a cluster exists -----------------------------------------------


def _kube_context() -> bool:
    from kubernetes import config

    try:
        config.list_kube_config_contexts()
    except (config.ConfigException, FileNotFoundError):
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _kube_context(), reason="no Kubernetes cluster: no kubeconfig/context")
def test_a_sync_run_on_kubernetes_trains_and_deleting_the_run_leaves_nothing(hetflow_env):
    """Needs the current context's namespace `default` to hold a ReadWriteMany claim `hetflow-home`
    that is this machine's HETFLOW_HOME (e.g. a hostPath volume of a kind cluster on this host)."""
    import kubernetes

    from hetflow.paths import run_paths
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.provision_cluster import provision_cluster
    from hetflow.tasks.teardown_cluster import teardown_cluster
    from hetflow.tasks.train import train
    from hetflow.tasks.validate_spec import validate_spec

    run = "kube-mwms-run"
    validate_spec(
        {"backend": "kubernetes", "strategy": "multi_worker_mirrored", "workers": 2, "epochs": 2, "steps_per_epoch": 5},
        run,
    )
    prepare_data(run)
    provision_cluster(run)
    try:
        assert train(run)["epochs"] == 2
        assert "Epoch 2/" in (run_paths(run).logs / "worker-0.log").read_text()
    finally:
        teardown_cluster(run)
    core = kubernetes.client.CoreV1Api()
    left = core.list_namespaced_pod("default", label_selector=f"hetflow.dev/run={run_slug(run)}").items
    assert all(p.metadata.deletion_timestamp for p in left)  # every pod is gone or going
    networking = kubernetes.client.NetworkingV1Api()
    assert not networking.list_namespaced_network_policy(
        "default", label_selector=f"hetflow.dev/run={run_slug(run)}"
    ).items

"""Docker and Kubernetes backends: the container configs and manifests they create, the linters of
docker/, and real runs where an engine or a cluster exists."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateRunning,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1Pod,
    V1PodStatus,
)

from hetflow.cluster import docker_backend as dk
from hetflow.cluster import kubernetes_backend as k8s
from hetflow.cluster import kubernetes_manifests as manifests
from hetflow.cluster.containers import lines_to_file
from hetflow.cluster.layout import plan_cluster, run_slug
from hetflow.cluster.supervisor import ReplicaState
from hetflow.spec import RunSpec, SpecError, parse_spec

RUN_ID = "manual__2026-11-22T00:12:03.120579+00:00"  # an Airflow run id: ':' and '+' included
HOME = Path("/srv/hetflow")
RUN_DIR = HOME / "runs" / "manual__2026-11-22T00_12_03.120579_00_00"
BIN = Path(sys.executable).parent
DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def ps_spec(backend: str, **values):
    return parse_spec({"backend": backend, "strategy": "parameter_server", "workers": 2, "ps": 1, **values})


def _roles_and_tasks(layout) -> list[tuple]:
    """Each replica's role, index, server flag and TF_CONFIG with every address replaced by the
    replica's name: what must not depend on the backend."""
    names = {r.address: r.name for r in layout.replicas}
    rows = []
    for replica in layout.replicas:
        config = json.loads(layout.tf_config(replica))
        cluster = {role: [names[a] for a in addresses] for role, addresses in config["cluster"].items()}
        rows.append((replica.role, replica.index, replica.serves_until_stopped, cluster, config["task"]))
    return rows


# --- layout: same roles and TF_CONFIG as the local backend, addresses by name ----------------------


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"strategy": "multi_worker_mirrored", "workers": 3, "batch_size": 48},
        {"strategy": "parameter_server", "workers": 2, "ps": 2},
    ],
)
def test_container_layouts_have_the_local_roles_and_tf_config_with_named_addresses(values):
    ports = iter(range(45000, 45010))
    local = plan_cluster(parse_spec(values), RUN_ID, pick_port=lambda: next(ports))
    docker_layout = dk.plan(parse_spec({**values, "backend": "docker"}), RUN_ID)
    kube_layout = k8s.plan(parse_spec({**values, "backend": "kubernetes"}), RUN_ID)
    assert _roles_and_tasks(docker_layout) == _roles_and_tasks(local) == _roles_and_tasks(kube_layout)
    slug = run_slug(RUN_ID)
    for replica in docker_layout.replicas:
        assert replica.address == f"hetflow-{slug}-{replica.name}:2222"
    for replica in kube_layout.replicas:
        # <pod hostname>.<headless service>: resolvable by name within the namespace
        assert replica.address == f"hetflow-{slug}-{replica.name}.hetflow-{slug}:2222"


def test_run_slug_is_a_dns_label_fragment_distinct_per_run():
    slugs = {run_slug(r) for r in (RUN_ID, RUN_ID.replace("+", ":"), "x" * 300, "RUN_1", "run-1")}
    assert len(slugs) == 5
    for slug in slugs:
        assert DNS_LABEL.match(slug) and len(slug) <= 30
        # the longest name built on it still fits a DNS label (63)
        assert len(f"hetflow-{slug}-worker-15") <= 63


# --- the spec keys of the backends ----------------------------------------------------------------


def test_container_only_keys_are_rejected_with_the_local_backend():
    with pytest.raises(SpecError) as caught:
        parse_spec({"replica_cpus": 2, "replica_memory_mb": 512, "request_gpus": True, "restart_policy": "on_failure"})
    # (restart_policy is honoured by every backend, the local one included)
    assert caught.value.problems == [
        f"{key}={value} is invalid with backend=local: expected {off} "
        "(limits and GPU requests apply to backend=docker, swarm or kubernetes)"
        for key, value, off in (
            ("replica_cpus", "2.0", "0.0"),
            ("replica_memory_mb", "512", "0"),
            ("request_gpus", "true", "false"),
        )
    ]
    with pytest.raises(SpecError, match=r"pin_cores=true is invalid with backend=kubernetes: expected false"):
        parse_spec({"backend": "kubernetes", "pin_cores": True})
    with pytest.raises(SpecError, match=r'kubernetes_namespace="Bad_NS" is invalid: expected a string matching'):
        parse_spec({"backend": "kubernetes", "kubernetes_namespace": "Bad_NS"})
    with pytest.raises(SpecError, match=r'backend="slurm" is invalid: expected one of local, docker, swarm, kube'):
        parse_spec({"backend": "slurm"})


# --- docker: network and container configs --------------------------------------------------------


def test_docker_network_is_internal_and_labelled_with_the_run():
    assert dk.network_config(RUN_ID, RUN_DIR) == {
        "name": f"hetflow-{run_slug(RUN_ID)}",
        "driver": "bridge",
        "internal": True,  # TF's gRPC servers listen on 0.0.0.0: nothing outside the run reaches them
        "labels": {"hetflow.run": run_slug(RUN_ID), "hetflow.run-id": RUN_ID, "hetflow.run-dir": str(RUN_DIR)},
    }


def test_docker_container_configs_carry_tf_config_labels_limits_and_gpus():
    spec = ps_spec("docker", replica_cpus=1.5, replica_memory_mb=2048, request_gpus=True, restart_policy="on_failure")
    layout = dk.plan(spec, RUN_ID)
    configs = {r.name: dk.container_config(layout, r, spec, HOME, RUN_DIR, "1000:1000", 12.5) for r in layout.replicas}
    assert set(configs) == {"chief-0", "worker-0", "worker-1", "ps-0"}
    for replica in layout.replicas:
        config = configs[replica.name]
        assert config["name"] == config["hostname"] == replica.host == f"hetflow-{run_slug(RUN_ID)}-{replica.name}"
        assert config["image"] == "hetflow-replica:0.1.0"
        # It ends itself once its supervisor is gone (hetflow.cluster.lease), as a local replica's keeper ends it.
        assert config["command"] == [
            "--run-dir",
            str(RUN_DIR),
            "--watch-supervisor",
            "lease",
            "--watch-supervisor",
            "heartbeat",
        ]
        assert config["environment"]["TF_CONFIG"] == layout.tf_config(replica)
        assert config["environment"]["HETFLOW_RUN_ID"] == RUN_ID
        assert config["environment"]["HETFLOW_HOME"] == str(HOME)
        assert config["environment"]["HETFLOW_LAUNCH_TIME"] == "12.5"
        assert config["labels"] == {
            "hetflow.run": run_slug(RUN_ID),
            "hetflow.run-id": RUN_ID,
            "hetflow.run-dir": str(RUN_DIR),
            "hetflow.role": replica.role,
            "hetflow.index": str(replica.index),
        }
        assert config["network"] == dk.network_name(RUN_ID)
        # its own run directory, and the prepared data read-only: nothing else of HETFLOW_HOME
        assert config["volumes"] == {
            str(RUN_DIR): {"bind": str(RUN_DIR), "mode": "rw"},
            str(HOME / "data"): {"bind": str(HOME / "data"), "mode": "ro"},
        }
        assert config["user"] == "1000:1000"
        assert config["nano_cpus"] == 1_500_000_000 and config["mem_limit"] == "2048m"
        assert config["restart_policy"] == {"Name": "no"}  # the supervisor restarts, on every backend
    # GPUs for the replicas that compute: not the ps, not the chief that only schedules
    gpus = {name: config.get("device_requests") for name, config in configs.items()}
    assert gpus == {
        "chief-0": None,
        "ps-0": None,
        "worker-0": [{"Driver": "", "Count": 1, "Capabilities": [["gpu"]]}],
        "worker-1": [{"Driver": "", "Count": 1, "Capabilities": [["gpu"]]}],
    }


def test_docker_config_without_limits_sets_none_and_never_restarts():
    spec = parse_spec({"backend": "docker", "strategy": "mirrored", "devices_per_worker": 2})
    layout = dk.plan(spec, RUN_ID)
    config = dk.container_config(layout, layout.replicas[0], spec, HOME, RUN_DIR, "0:0", 0.0)
    assert not {"nano_cpus", "mem_limit", "device_requests"} & set(config)
    assert config["restart_policy"] == {"Name": "no"}
    # The container's own deadline: the keeper's attach timeout (600 s) plus train_timeout_seconds (3600 s).
    assert config["entrypoint"] == ["timeout", "--kill-after=10", "4200", "python", "-m", "hetflow.replica"]
    with_gpus = parse_spec({"backend": "docker", "strategy": "mirrored", "devices_per_worker": 2, "request_gpus": True})
    config = dk.container_config(layout, layout.replicas[0], with_gpus, HOME, RUN_DIR, "0:0", 0.0)
    assert config["device_requests"][0]["Count"] == 2


def test_every_backend_and_the_replica_read_a_workers_gpus_from_one_place():
    """What a container asks for is what its replica uses (RunSpec.worker_device): with request_gpus
    the workers compute on their GPUs; a CPU worker of a mixed cluster asks for none."""
    from hetflow.cluster.containers import replica_gpus
    from hetflow.replica.runtime import replica_device

    spec = parse_spec({"backend": "docker", "strategy": "mirrored", "devices_per_worker": 2, "request_gpus": True})
    [worker] = dk.plan(spec, RUN_ID).replicas
    device = replica_device(spec, {"type": "worker", "index": 0})
    assert (device.device, device.count) == ("gpu", 2) and replica_gpus(spec, worker) == 2
    mixed = [{"device": "gpu", "count": 2}, {"device": "cpu"}]
    spec = parse_spec(
        {
            "backend": "swarm",
            "strategy": "parameter_server",
            "workers": 2,
            "ps": 1,
            "request_gpus": True,
            "worker_devices": mixed,
        }
    )
    assert {r.name: replica_gpus(spec, r) for r in dk.plan(spec, RUN_ID).replicas} == {
        "chief-0": 0,
        "worker-0": 2,
        "worker-1": 0,
        "ps-0": 0,
    }


def test_a_replica_container_runs_unprivileged_on_a_read_only_root_and_sees_the_records_read_only(monkeypatch):
    from hetflow.cluster import containers

    spec = parse_spec({"backend": "docker", "strategy": "multi_worker_mirrored", "workers": 2})
    layout = dk.plan(spec, RUN_ID)
    record = RUN_DIR / "spec.json"
    config = dk.container_config(layout, layout.replicas[0], spec, HOME, RUN_DIR, "65534:65534", 0.0, [record])
    assert config["cap_drop"] == ["ALL"] and config["security_opt"] == ["no-new-privileges"]
    assert config["read_only"] is True and "/tmp" in config["tmpfs"] and config["pids_limit"] == containers.PIDS_LIMIT
    assert config["volumes"][str(record)] == {"bind": str(record), "mode": "ro"}
    assert config["volumes"][str(RUN_DIR)] == {"bind": str(RUN_DIR), "mode": "rw"}
    monkeypatch.setattr(containers.os, "geteuid", lambda: 0)
    assert containers.container_user() == "65534:65534"  # never root, even where the supervisor is


def test_docker_container_state_from_inspect():
    assert dk.replica_state({"State": {"Status": "running", "ExitCode": 0}}) == ReplicaState()
    assert dk.replica_state({"State": {"Status": "exited", "ExitCode": 137}}) == ReplicaState(137)
    assert dk.replica_state({"State": {"Status": "created", "ExitCode": 0}}) == ReplicaState()


def test_a_slower_worker_is_a_container_with_a_smaller_cpu_quota_and_pinning_is_a_cpuset():
    devices = [{"device": "cpu"}, {"device": "cpu", "slowdown": 2}]
    spec = parse_spec(
        {"backend": "docker", "strategy": "multi_worker_mirrored", "workers": 2, "worker_devices": devices}
    )
    layout = dk.plan(spec, RUN_ID)
    configs = [dk.container_config(layout, r, spec, HOME, RUN_DIR, "0:0", 0.0) for r in layout.replicas]
    # half of one core, where replica_cpus is unset; the other worker is not limited
    assert [c.get("nano_cpus") for c in configs] == [None, 500_000_000]
    limited = spec.model_copy(update={"replica_cpus": 1.5, "pin_cores": True})
    configs = [dk.container_config(layout, r, limited, HOME, RUN_DIR, "0:0", 0.0) for r in layout.replicas]
    assert [c["nano_cpus"] for c in configs] == [1_500_000_000, 750_000_000]
    assert len({c["cpuset_cpus"] for c in configs}) == min(2, len(os.sched_getaffinity(0)))


# --- kubernetes: manifests ------------------------------------------------------------------------

OWNER = manifests.owner_reference(manifests.run_name(RUN_ID), "0b8e4a3c-6f0e-4a8e-9c1b-2d3e4f5a6b7c")


def _manifests(spec):
    layout = k8s.plan(spec, RUN_ID)
    pods = {r.name: manifests.replica_pod(layout, r, spec, RUN_DIR, OWNER, 12.5) for r in layout.replicas}
    return layout, manifests.headless_service(layout, spec.kubernetes_namespace, OWNER), pods


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
        assert pod["spec"]["activeDeadlineSeconds"] > spec.train_timeout_seconds
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["TF_CONFIG"] == layout.tf_config(replica)
        assert env["HETFLOW_RUN_ID"] == RUN_ID and env["HETFLOW_HOME"] == str(HOME)
        assert container["args"] == ["--run-dir", str(RUN_DIR)]
        assert container["ports"] == [{"name": "grpc", "containerPort": 2222}]
        # Its own run directory and the data, read-only; not the rest of HETFLOW_HOME.
        assert container["volumeMounts"] == [
            {"name": "hetflow-home", "mountPath": str(RUN_DIR), "subPath": f"runs/{RUN_DIR.name}"},
            {"name": "hetflow-home", "mountPath": str(HOME / "data"), "subPath": "data", "readOnly": True},
        ]
        assert pod["spec"]["volumes"] == [
            {"name": "hetflow-home", "persistentVolumeClaim": {"claimName": "hetflow-home"}}
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


def _closed(schema):
    """The CRD's schema as the API server applies it to our objects: a field it does not declare
    would be pruned silently, so here it is an error (objects that preserve unknown fields stay open)."""
    if isinstance(schema, dict):
        schema = {key: _closed(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            if not schema.get("x-kubernetes-preserve-unknown-fields"):
                schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_closed(item) for item in schema]
    return schema


TFJOB_CRD = Path(__file__).parent / "schemas" / "kubeflow.org_tfjobs.yaml"  # schemas/README.md: its source


@pytest.mark.parametrize("shape", ["sync", "async"])
def test_the_tfjob_is_valid_against_the_training_operators_own_crd_schema(shape):
    import jsonschema

    crd = yaml.safe_load(TFJOB_CRD.read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    validator = jsonschema.Draft7Validator(_closed(version["schema"]["openAPIV3Schema"]))
    if shape == "sync":
        spec = parse_spec({"backend": "kubernetes", "strategy": "multi_worker_mirrored", "workers": 2})
    else:
        spec = ps_spec("kubernetes", restart_policy="on_failure", replica_cpus=2, replica_memory_mb=4096)
    tfjob = manifests.tfjob_manifest(k8s.plan(spec, RUN_ID), spec, RUN_DIR)
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(tfjob)]
    assert errors == []
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


def test_log_chunks_become_lines_and_the_log_file(tmp_path):
    lines = lines_to_file([b"Epoch 1/", b"2\nloss 0.5\nEpo", b"ch 2/2"], tmp_path / "w.log")
    assert list(lines) == ["Epoch 1/2", "loss 0.5", "Epoch 2/2"]
    assert (tmp_path / "w.log").read_text() == "Epoch 1/2\nloss 0.5\nEpoch 2/2\n"


# --- linters of docker/ ---------------------------------------------------------------------------


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=REPO)


def test_dockerfile_passes_hadolint_and_hadolint_rejects_a_bad_one(tmp_path):
    result = _run(BIN / "hadolint", "docker/Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nUSER root\n")
    result = _run(BIN / "hadolint", bad)
    assert result.returncode != 0 and "DL3007" in result.stdout  # "latest" is not a pinned base image


def test_compose_file_passes_the_compose_schema_and_the_schema_rejects_a_bad_one(tmp_path):
    result = _run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", "docker/compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  mlflow:\n    image: x\n    restart_policy: always\n")
    result = _run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", bad)
    assert result.returncode != 0 and "restart_policy" in result.stdout


def test_compose_stack_has_postgres_airflow_and_mlflow_on_a_shared_home():
    compose = yaml.safe_load((REPO / "docker/compose.yaml").read_text())
    services = compose["services"]
    assert {
        "postgres",
        "airflow-apiserver",
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
        "mlflow",
    } <= set(services)
    store = services["mlflow"]["environment"]["MLFLOW_BACKEND_STORE_URI"]  # its password kept off `ps`
    assert store.startswith("postgresql") and store.endswith("@postgres/mlflow")
    assert "--artifacts-destination=${HETFLOW_HOME}/mlflow-artifacts" in services["mlflow"]["command"]
    for name in ("airflow-scheduler", "mlflow"):
        assert "${HETFLOW_HOME}:${HETFLOW_HOME}" in services[name]["volumes"]
    assert "postgresql" in services["airflow-scheduler"]["environment"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    assert all(port.startswith("127.0.0.1:") for s in services.values() for port in s.get("ports", []))


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


def test_every_backend_a_spec_can_name_implements_the_one_interface():
    """backend_for is the one choice: each value of spec.backend has a module whose BACKEND has
    every method of the Backend protocol, and no other module asks which backend a spec names."""
    import inspect
    import typing

    from hetflow.cluster.backends import Backend, backend_for

    names = typing.get_args(RunSpec.model_fields["backend"].annotation)
    assert set(names) == {"local", "docker", "swarm", "kubernetes"}
    wanted = {name for name, _ in inspect.getmembers(Backend, inspect.isfunction) if not name.startswith("_")}
    for name in names:
        backend = backend_for(RunSpec(backend=name))
        assert {m for m in wanted if callable(getattr(backend, m, None))} == wanted, name
        assert backend.loss_report_seconds >= 0
    chains = [
        str(path.relative_to(REPO))
        for path in (REPO / "hetflow").rglob("*.py")
        if path.name != "spec.py" and re.search(r"backend\s*(==|!=|in \()", path.read_text())
    ]
    assert chains == []


def test_a_replica_log_planted_as_a_link_is_not_followed(tmp_path):
    """A replica that put a link at its log's name (to a file of the pipeline's, say) gets its
    output refused, and the link's target stays untouched."""
    target = tmp_path / "secrets.json"
    target.write_text("{}")
    (tmp_path / "w.log").symlink_to(target)
    with pytest.raises(OSError):
        list(lines_to_file([b"line\n"], tmp_path / "w.log"))
    assert target.read_text() == "{}"

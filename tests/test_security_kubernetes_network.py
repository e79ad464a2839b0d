"""The NetworkPolicy of a kubernetes run (hetflow/cluster/backends/kubernetes/manifests.py): it admits only the
run's own pods, on the gRPC port, passes strict schema validation, is created before any pod, owned
by the run, and deleted with it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from cluster_run import OWNER, RUN_DIR, RUN_ID
from kubernetes_pods import _FakeApi, _specs

from hetflow.cluster.backends.kubernetes import backend as k8s
from hetflow.cluster.backends.kubernetes import manifests as manifests
from hetflow.cluster.layout import run_slug

BIN = Path(sys.executable).parent


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) == {"matchLabels"}  # no expressions: the run's labels only
    return selector["matchLabels"].items() <= labels.items()


def test_network_policy_admits_the_runs_pods_only_on_the_grpc_port():
    spec = _specs()["parameter_server"]
    layout = k8s.plan(spec, RUN_ID)
    policy = manifests.run_network_policy(layout, "ml", OWNER)
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    assert policy["metadata"]["namespace"] == "ml"
    assert policy["metadata"]["labels"][manifests.LABEL_RUN] == run_slug(RUN_ID)  # what teardown selects on
    assert policy["metadata"]["ownerReferences"] == [OWNER]  # deleted with the run
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]  # egress: tests/test_cluster_kubernetes_manifests.py
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector, no ipBlock: this namespace's pods only
    assert rule["ports"] == [{"protocol": "TCP", "port": 2222}]
    assert {int(r.address.rsplit(":", 1)[1]) for r in layout.replicas} == {2222}  # TF_CONFIG's port

    other_layout = k8s.plan(spec, "manual__another-run")
    ours = [manifests.replica_pod(layout, r, spec, RUN_DIR, OWNER, 0)["metadata"]["labels"] for r in layout.replicas]
    theirs = [
        manifests.replica_pod(other_layout, r, spec, RUN_DIR, OWNER, 0)["metadata"]["labels"] for r in layout.replicas
    ]
    for selector in (policy["spec"]["podSelector"], peer["podSelector"]):
        assert all(_selects(selector, labels) for labels in ours)
        assert not any(_selects(selector, labels) for labels in theirs)
    # The TFJob's pods carry the run's labels too, so its policy (in tfjob.yaml) selects them.
    for replicas in manifests.tfjob_manifest(layout, spec, RUN_DIR)["spec"]["tfReplicaSpecs"].values():
        assert _selects(policy["spec"]["podSelector"], replicas["template"]["metadata"]["labels"])


def test_network_policy_passes_strict_schema_validation(tmp_path):
    layout = k8s.plan(_specs()["parameter_server"], RUN_ID)
    manifest = tmp_path / "policy.yaml"
    policy = manifests.run_network_policy(layout, "ml", OWNER)
    manifest.write_text(yaml.safe_dump_all([policy, manifests.run_network_policy(layout, "ml", None)]))
    result = subprocess.run([BIN / "kubernetes-validate", "--strict", manifest], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    policy["spec"]["ingress"][0]["form"] = policy["spec"]["ingress"][0].pop("from")  # and the check bites
    manifest.write_text(yaml.safe_dump(policy))
    result = subprocess.run([BIN / "kubernetes-validate", "--strict", manifest], capture_output=True, text=True)
    assert result.returncode != 0 and "form" in result.stdout + result.stderr


def test_provision_creates_the_policy_owned_by_the_run_before_any_pod(tmp_path):
    spec = _specs()["parameter_server"]
    run_dir = tmp_path / "runs" / "r"
    calls = []
    api = _FakeApi(calls)
    k8s.KubernetesReplicas(k8s.plan(spec, RUN_ID), spec, run_dir, core=api, networking=api).provision()
    created = [(method, args[1]) for method, args, _ in calls if method.startswith("create_")]
    order = [method for method, _ in created]
    assert order.index("create_namespaced_network_policy") < order.index("create_namespaced_pod")
    (policy,) = [body for method, body in created if method == "create_namespaced_network_policy"]
    assert policy == manifests.run_network_policy(
        k8s.plan(spec, RUN_ID), "ml", manifests.owner_reference(manifests.run_name(RUN_ID), "uid-1")
    )
    # tfjob.yaml, for `kubectl apply -f`, brings the same isolation.
    kinds = [doc["kind"] for doc in yaml.safe_load_all((run_dir / "tfjob.yaml").read_text())]
    assert kinds == ["TFJob", "NetworkPolicy"]


def test_teardown_deletes_the_runs_network_policy_found_by_label():
    calls = []
    api = _FakeApi(calls)
    deleted = k8s.teardown_run(RUN_ID, "ml", core=api, networking=api)
    assert "networkpolicy/obj" in deleted
    assert ("delete_namespaced_network_policy", ("obj", "ml")) in [(m, a) for m, a, _ in calls]

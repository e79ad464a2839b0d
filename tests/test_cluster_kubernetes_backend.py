"""``hetflow sweep`` on Kubernetes: the runs nobody holds lose their pods, service, NetworkPolicy and
ConfigMap, and nothing of a live run or of another HETFLOW_HOME goes; a teardown gives the pods the
grace it was given. No cluster can run here, so the runs are provisioned by the real backend into
``_Cluster``, which keeps what the API server would return (the client's own model objects, made by
the client's own deserializer from the JSON of what was created, with a namespace, uid and creation
time) and answers lists by label selector as the API server does. Without any client configuration
the sweep has nothing to do and says nothing; with a kubeconfig whose server does not answer it warns
once and goes on."""

from __future__ import annotations

import json
import logging
import shutil
from datetime import datetime, timezone

import kubernetes.client
import kubernetes.config.kube_config
import pytest
from kubernetes.client.exceptions import ApiException

from hetflow.cluster.backends.kubernetes import backend as k8s
from hetflow.cluster.backends.kubernetes.manifests import LABEL_RUN
from hetflow.cluster.layout import run_slug
from hetflow.spec import parse_spec

# Object kinds as the backend creates, lists and deletes them: API method suffix and model name.
KINDS = {
    "config_map": "V1ConfigMap",
    "service": "V1Service",
    "network_policy": "V1NetworkPolicy",
    "pod": "V1Pod",
}


def _selected(labels: dict | None, selector: str) -> bool:
    """A label selector of ``key`` or ``key=value`` terms, comma-separated (what the backend sends)."""
    labels = labels or {}
    for term in selector.split(","):
        key, _, value = term.partition("=")
        if key not in labels or (value and labels[key] != value):
            return False
    return True


class _Cluster:
    """One object standing for CoreV1Api and NetworkingV1Api over an in-memory API server: creates
    store the client's models of what was sent, lists filter by namespace and label, deletes remove
    by name or answer 404. ``forbid_all_namespaces`` answers 403 to listing across namespaces, as
    for an identity that holds only a Role; ``forbid_deletes_in`` 403 to deleting in those namespaces."""

    def __init__(self, forbid_all_namespaces: bool = False, forbid_deletes_in: tuple[str, ...] = ()):
        self.objects: dict[str, list] = {kind: [] for kind in KINDS}
        self.forbid_all_namespaces = forbid_all_namespaces
        self.forbid_deletes_in = forbid_deletes_in
        self._client = kubernetes.client.ApiClient()
        self._uids = 0
        self.grace_given: dict[str, int] = {}  # kind/name: the grace_period_seconds of its deletion

    def __getattr__(self, method: str):
        for kind, model in KINDS.items():
            if method == f"create_namespaced_{kind}":
                return lambda namespace, body: self._create(kind, model, namespace, body)
            if method == f"list_namespaced_{kind}":
                return lambda namespace, label_selector, **_: self._list(kind, model, namespace, label_selector)
            if method == f"list_{kind}_for_all_namespaces":
                return lambda label_selector, **_: self._list(kind, model, None, label_selector)
            if method == f"delete_namespaced_{kind}":
                return lambda name, namespace, grace_period_seconds=None, **_: self._delete(
                    kind, name, namespace, grace_period_seconds
                )
        raise AttributeError(method)

    def _create(self, kind: str, model: str, namespace: str, body: dict):
        self._uids += 1
        metadata = {
            **body["metadata"],
            "namespace": namespace,
            "uid": f"uid-{self._uids}",
            "creationTimestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        response = json.dumps({**body, "metadata": metadata})
        created = self._client.deserialize(response, model, "application/json")
        self.objects[kind].append(created)
        return created

    def _list(self, kind: str, model: str, namespace: str | None, selector: str):
        if namespace is None and self.forbid_all_namespaces:
            raise ApiException(status=403, reason="Forbidden")
        items = [
            o
            for o in self.objects[kind]
            if namespace in (None, o.metadata.namespace) and _selected(o.metadata.labels, selector)
        ]
        return getattr(kubernetes.client, f"{model}List")(items=items)

    def _delete(self, kind: str, name: str, namespace: str, grace_period_seconds: int | None):
        if namespace in self.forbid_deletes_in:
            raise ApiException(status=403, reason="Forbidden")
        for found in self.objects[kind]:
            if (found.metadata.name, found.metadata.namespace) == (name, namespace):
                self.objects[kind].remove(found)
                self.grace_given[f"{kind}/{name}"] = grace_period_seconds
                return kubernetes.client.V1Status(status="Success")
        raise ApiException(status=404, reason="Not Found")

    def names(self, run_id: str | None = None) -> set[str]:
        """``namespace/kind/name`` of every object, or of the run's (by its label)."""
        return {
            f"{o.metadata.namespace}/{o.kind.lower()}/{o.metadata.name}"
            for kind in KINDS
            for o in self.objects[kind]
            if run_id is None or o.metadata.labels[LABEL_RUN] == run_slug(run_id)
        }


def _provision(cluster: _Cluster, run_id: str, run_dir, namespace: str = "ml") -> k8s.KubernetesReplicas:
    """A run provisioned by the backend as it provisions one: ConfigMap, policy, service, pods."""
    spec = parse_spec(
        {"backend": "kubernetes", "strategy": "multi_worker_mirrored", "workers": 2, "kubernetes_namespace": namespace}
    )
    run_dir.mkdir(parents=True)
    replicas = k8s.KubernetesReplicas(k8s.plan(spec, run_id), spec, run_dir, core=cluster, networking=cluster)
    replicas.provision()
    return replicas


def test_the_runs_nobody_holds_are_deleted_and_live_and_other_homes_runs_stay(tmp_path):
    home = tmp_path / "home"
    cluster = _Cluster()
    _provision(cluster, "interrupted", home / "runs" / "interrupted-1")
    supervised = _provision(cluster, "supervised", home / "runs" / "supervised-1")
    _provision(cluster, "theirs", tmp_path / "other-home" / "runs" / "theirs-1")
    _provision(cluster, "gone", home / "runs" / "gone-1", namespace="default")
    shutil.rmtree(home / "runs" / "gone-1")  # its run directory deleted: nothing will supervise it
    interrupted, gone = cluster.names("interrupted"), cluster.names("gone")
    # ConfigMap, policy, service and two pods each, in their own namespaces.
    assert len(interrupted) == len(gone) == 5 and {n.split("/")[0] for n in interrupted | gone} == {"ml", "default"}
    supervised.attach()  # what the train task does: it holds the run's lease while it supervises
    try:
        # Just provisioned: only the run without a run directory goes at once.
        assert set(k8s.sweep_runs(home, 600, cluster, cluster)["kubernetes objects"]) == gone
        before = cluster.names()
        removed = k8s.sweep_runs(home, 0, cluster, cluster)
        assert set(removed["kubernetes objects"]) == interrupted
        assert cluster.names() == before - interrupted
        assert cluster.names("supervised") and cluster.names("theirs")
    finally:
        supervised.detach()
    # Once its supervisor lets go, the run is nobody's.
    once_supervised = cluster.names("supervised")
    assert set(k8s.sweep_runs(home, 0, cluster, cluster)["kubernetes objects"]) == once_supervised
    assert cluster.names() == cluster.names("theirs")


def test_where_listing_across_namespaces_is_forbidden_the_default_namespace_is_swept(tmp_path, caplog):
    home = tmp_path / "home"
    cluster = _Cluster(forbid_all_namespaces=True)
    _provision(cluster, "in-default", home / "runs" / "in-default-1", namespace="default")
    _provision(cluster, "in-ml", home / "runs" / "in-ml-1", namespace="ml")
    in_default, in_ml = cluster.names("in-default"), cluster.names("in-ml")
    with caplog.at_level(logging.INFO):
        removed = k8s.sweep_runs(home, 0, cluster, cluster)
    assert set(removed["kubernetes objects"]) == in_default
    assert cluster.names() == in_ml  # out of this identity's sight
    assert "looking in namespace default only" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_run_that_may_not_be_deleted_is_a_warning_and_the_other_runs_still_go(tmp_path, caplog):
    home = tmp_path / "home"
    cluster = _Cluster(forbid_deletes_in=("ml",))
    _provision(cluster, "guarded", home / "runs" / "guarded-1", namespace="ml")
    _provision(cluster, "open", home / "runs" / "open-1", namespace="default")
    guarded, opened = cluster.names("guarded"), cluster.names("open")
    removed = k8s.sweep_runs(home, 0, cluster, cluster)
    assert set(removed["kubernetes objects"]) == opened and cluster.names() == guarded
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "could not tear down Kubernetes run guarded in ml: Forbidden" in warnings[0]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture
def no_cluster_configured(tmp_path, monkeypatch):
    """Neither a kubeconfig nor a pod's service account, whatever the machine running the tests has."""
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)


def test_without_a_client_configuration_the_sweep_has_nothing_to_do_and_says_nothing(
    tmp_path, caplog, no_cluster_configured
):
    from hetflow.cluster.backends.base import sweep

    with caplog.at_level(logging.DEBUG):
        assert k8s.BACKEND.sweep(tmp_path, 0) == {}
        assert "kubernetes objects" not in sweep(tmp_path)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_cluster_that_does_not_answer_is_one_warning_not_an_error(tmp_path, caplog, monkeypatch):
    """Through ``hetflow sweep``'s own function: every backend's sweep runs, Kubernetes' among them."""
    import socket

    from hetflow.cluster.backends.base import sweep

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "off", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "me", "user": {"token": "t"}}],
                "contexts": [{"name": "off", "context": {"cluster": "off", "user": "me"}}],
                "current-context": "off",
            }
        )
    )
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    with caplog.at_level(logging.INFO):
        assert "kubernetes objects" not in sweep(tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "the Kubernetes API did not answer" in warnings[0]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_teardown_gives_the_runs_pods_the_grace_it_was_given(tmp_path, monkeypatch):
    cluster = _Cluster()
    monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda: cluster)
    monkeypatch.setattr(kubernetes.client, "NetworkingV1Api", lambda: cluster)
    monkeypatch.setattr(k8s, "load_client_config", lambda: None)
    spec = parse_spec({"backend": "kubernetes", "strategy": "multi_worker_mirrored", "workers": 2})
    for run_id, grace, expected in (("stopped", 2.0, 2), ("ended", None, 10)):  # the train task's SIGTERM, a teardown
        _provision(cluster, run_id, tmp_path / run_id, namespace="default")
        k8s.BACKEND.teardown(spec, run_id, grace=grace)
        pods = {
            name: seconds for name, seconds in cluster.grace_given.items() if name.startswith("pod/") and run_id in name
        }
        assert len(pods) == 2 and set(pods.values()) == {expected}, cluster.grace_given

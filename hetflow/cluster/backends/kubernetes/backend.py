"""Kubernetes backend: one pod per replica behind one headless service, all owned by the run's
ConfigMap, so deleting that one object makes Kubernetes' garbage collector delete everything of the
run, whoever deletes it. Each pod sets ``hostname`` and ``subdomain`` (the headless service), which
gives it the DNS name ``hetflow-<run>-worker-0.hetflow-<run>`` that its TF_CONFIG uses; the service
publishes addresses of pods that are not ready yet, since TensorFlow resolves its peers while they
all start.

The manifests are ``hetflow.cluster.backends.kubernetes.manifests``'; ``KubernetesReplicas`` only creates,
inspects and deletes for the one supervisor (``hetflow.cluster.supervisor``); the kubelet restarts a
failed container in its pod (restartPolicy), and the supervisor counts those restarts. The
supervisor must mount the claim that holds HETFLOW_HOME at the same path as the pods do. The run's
NetworkPolicy takes effect where the cluster's network plugin enforces NetworkPolicies.

``hetflow sweep`` finds runs by their ConfigMap, which names the run directory, and tears down
those no supervisor holds, by the rule every backend's sweep keeps (``hetflow.cluster.sweep``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import kubernetes.client
import kubernetes.config
import urllib3
import yaml
from kubernetes.client.exceptions import ApiException

from hetflow.cluster.backends.base import Backend, Replicas, ReplicaState
from hetflow.cluster.backends.kubernetes.manifests import (
    ANNOTATION_RUN_DIR,
    ANNOTATION_RUN_ID,
    IMAGE_USER,
    LABEL_INDEX,
    LABEL_ROLE,
    LABEL_RUN,
    headless_service,
    owner_reference,
    pod_name,
    replica_host,
    replica_pod,
    run_configmap,
    run_network_policy,
    tfjob_manifest,
)
from hetflow.cluster.containers import (
    STOP_GRACE_SECONDS,
    lines_to_file,
    prepare_run_dir,
)
from hetflow.cluster.layout import ClusterLayout, plan_named_cluster, run_slug
from hetflow.cluster.lease import take_lease
from hetflow.cluster.output_lines import cut_lines
from hetflow.cluster.replica_view import hand_over_writable
from hetflow.paths import RunPaths, hetflow_home
from hetflow.spec import RunSpec

log = logging.getLogger("hetflow.cluster")

# Waiting reasons after which a pod will never start by itself.
_STUCK_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError")

# Every teardown sweeps: an API server that does not answer (a kubeconfig for a cluster that is
# off) costs it this long, once (seconds to connect, to read the listing).
SWEEP_LIST_TIMEOUT = (5, 30)


def plan(spec: RunSpec, run_id: str) -> ClusterLayout:
    return plan_named_cluster(spec, run_id, lambda name: replica_host(run_id, name))


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


POD_OWNER = (IMAGE_USER, IMAGE_USER)


def hand_over_to_pods(paths: RunPaths) -> None:
    """What the pods write (the run directory's output folder and all in it) becomes IMAGE_USER's where
    the supervisor is root; a supervisor running as IMAGE_USER already owns it. Only this directory:
    the pods set no fsGroup, which would have the kubelet hand them the whole claim."""
    hand_over_writable(paths, POD_OWNER)


def pod_access_problems(spec: RunSpec) -> list[str]:
    """Whether this process can make a run directory the pods' uid's, tried on a scratch directory
    beside the runs (the claim may refuse even root: NFS's root_squash); one line if it cannot."""
    runs = hetflow_home() / "runs"
    scratch = None
    try:
        runs.mkdir(parents=True, exist_ok=True)
        scratch = RunPaths(Path(tempfile.mkdtemp(prefix=".pod-access-", dir=runs)))
        hand_over_to_pods(scratch)
        owner = scratch.output.stat().st_uid
        why = f"it stays uid {owner}'s"
    except PermissionError as error:
        owner, why = None, f"{error.strerror}: {error.filename}"
    finally:
        if scratch is not None:
            shutil.rmtree(scratch.root)
    if owner == IMAGE_USER:
        return []
    return [
        f"kubernetes_volume_claim={spec.cluster.kubernetes.volume_claim!r}: the pods run as uid {IMAGE_USER} "
        "and must own "
        f"their run directory under {runs}, which this process (uid {os.geteuid()}) cannot give them ({why}); "
        f"run the Airflow tasks as root (on NFS, from an export without root_squash) or as uid {IMAGE_USER}"
    ]


def load_client_config() -> None:
    """The kubeconfig of the user (or KUBECONFIG), or else the pod's service account when the
    supervisor itself runs in the cluster."""
    try:
        kubernetes.config.load_kube_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_incluster_config()


class KubernetesReplicas(Replicas):
    """The kubernetes backend's side of the supervision (``supervisor.Replicas``): creates,
    inspects and deletes the pods of one run."""

    restarts_in_place = True

    def __init__(self, layout: ClusterLayout, spec: RunSpec, run_dir: Path, core=None, networking=None):
        self.layout = layout
        self.spec = spec
        self.namespace = spec.cluster.kubernetes.namespace
        self.run_dir = run_dir
        self.logs_dir = RunPaths(run_dir).logs
        if core is None:
            load_client_config()
        self.core = core or kubernetes.client.CoreV1Api()
        self.networking = networking or kubernetes.client.NetworkingV1Api()
        self._owner = None

    def provision(self) -> None:
        """The run's output folder cleared of what replicas planted and handed to the pods (the rest
        of the run directory they see read-only), then its ConfigMap, its NetworkPolicy, its headless
        service and every replica's pod."""
        prepare_run_dir(RunPaths(self.run_dir), POD_OWNER)
        # For clusters with the training operator: the same run, to `kubectl apply` instead. A person
        # applies it: this run's pods see it read-only too.
        tfjob = RunPaths(self.run_dir).tfjob
        tfjob.write_text(
            yaml.safe_dump_all(
                [
                    tfjob_manifest(self.layout, self.spec, self.run_dir),
                    run_network_policy(self.layout, self.namespace, None),
                ]
            )
        )
        run = self.core.create_namespaced_config_map(
            self.namespace, run_configmap(self.layout, self.spec, self.namespace, self.run_dir)
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
            yield from lines_to_file(cut_lines(stream.stream()), self.logs_dir / f"{name}.log")
        except ApiException:  # deleted while streaming: its output is in the file
            return

    def attach(self) -> None:
        """Pods do not depend on their supervisor (teardown and their activeDeadlineSeconds end
        them), but the supervisor holds the run's lease: `hetflow sweep` leaves a supervised run alone."""
        self._lease = take_lease(self.run_dir)

    def detach(self) -> None:
        self._lease.close()

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


def teardown_run(
    run_id: str, namespace: str, core=None, networking=None, grace: float = STOP_GRACE_SECONDS
) -> list[str]:
    """Delete the run's ConfigMap (the garbage collector deletes what it owns) and, for what an
    interrupted start left without an owner, every pod, service and NetworkPolicy with the run's
    label, each given ``grace`` whole seconds to stop. Returns the names deleted."""
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
                delete(item.metadata.name, namespace, grace_period_seconds=int(grace))
                deleted.append(f"{kind}/{item.metadata.name}")
            except ApiException as error:
                if error.status != 404:
                    raise
    return deleted


def sweep_client():
    """CoreV1Api and NetworkingV1Api for the sweep, from the kubeconfig or the pod's service
    account; None where there is neither (no cluster to sweep). A client of its own that does not
    retry, so that an unreachable cluster delays no teardown for long (the next sweep tries again)."""
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_kube_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            return None
    configuration.retries = 0
    api = kubernetes.client.ApiClient(configuration)
    return kubernetes.client.CoreV1Api(api), kubernetes.client.NetworkingV1Api(api)


def _run_configmaps(core) -> list:
    """Every run's ConfigMap the identity may list: in every namespace, or where it may not list
    across namespaces (a Role, not a ClusterRole), in the spec's default namespace."""
    try:
        return core.list_config_map_for_all_namespaces(
            label_selector=LABEL_RUN, _request_timeout=SWEEP_LIST_TIMEOUT
        ).items
    except ApiException as error:
        if error.status != 403:
            raise
    namespace = RunSpec().cluster.kubernetes.namespace
    log.info("sweep: not allowed to list ConfigMaps across namespaces; looking in namespace %s only", namespace)
    try:
        return core.list_namespaced_config_map(
            namespace, label_selector=LABEL_RUN, _request_timeout=SWEEP_LIST_TIMEOUT
        ).items
    except ApiException as error:
        if error.status != 403:
            raise
        log.warning(
            "sweep: not allowed to list ConfigMaps in namespace %s: its Kubernetes runs were not swept", namespace
        )
        return []


def sweep_runs(home: Path, attach_seconds: float | None = None, core=None, networking=None) -> dict[str, list[str]]:
    """Tear down the Kubernetes runs of this home that no supervisor holds; returns what was deleted
    as ``namespace/kind/name``. Nothing to do (and nothing returned) without a client configuration."""
    from hetflow.cluster.sweep import interrupted_runs

    if core is None:
        apis = sweep_client()
        if apis is None:
            return {}
        core, networking = apis
    try:
        configmaps = _run_configmaps(core)
    except urllib3.exceptions.HTTPError as error:
        log.warning(
            "sweep: the Kubernetes API did not answer (%s): its hetflow runs were not swept",
            getattr(error, "reason", None) or error,
        )
        return {}
    parts, namespaces = [], {}
    for configmap in configmaps:
        metadata = configmap.metadata
        annotations = metadata.annotations or {}
        if ANNOTATION_RUN_DIR not in annotations:  # made before runs were annotated with their directory
            continue
        run_id = annotations[ANNOTATION_RUN_ID]
        parts.append((run_id, annotations[ANNOTATION_RUN_DIR], metadata.creation_timestamp.timestamp()))
        namespaces[run_id] = metadata.namespace
    deleted = []
    for run_id in interrupted_runs(parts, home, attach_seconds):
        namespace = namespaces[run_id]
        try:
            names = teardown_run(run_id, namespace, core, networking)
        except ApiException as error:  # not allowed to delete there: the other runs still go
            log.warning("sweep: could not tear down Kubernetes run %s in %s: %s", run_id, namespace, error.reason)
            continue
        deleted += [f"{namespace}/{name}" for name in names]
        log.info("sweep: deleted the pods, service, policy and ConfigMap of interrupted Kubernetes run %s", run_id)
    return {"kubernetes objects": deleted}


class KubernetesBackend(Backend):
    """backend=kubernetes as a ``Backend`` (``hetflow.cluster.backends.base``)."""

    replicas_type = KubernetesReplicas
    plan = staticmethod(plan)
    sweep = staticmethod(sweep_runs)

    def preflight(self, spec: RunSpec, run_id: str) -> list[str]:
        # Only the claim (mounted here) is tried: the API server validates what is created.
        return pod_access_problems(spec)

    def teardown(self, spec: RunSpec, run_id: str, grace: float | None = None) -> list[str]:
        return teardown_run(
            run_id, spec.cluster.kubernetes.namespace, grace=STOP_GRACE_SECONDS if grace is None else grace
        )


BACKEND = KubernetesBackend()

"""What the Kubernetes security tests render and check: two specs (``_specs``), every pod spec the
backend renders for one (``_pod_specs``: its own pods and the TFJob's templates), the restricted Pod
Security Standard spelled out as checks (``restricted_violations``,
https://kubernetes.io/docs/concepts/security/pod-security-standards/), and a stand-in for the
Kubernetes API that records its calls (``_FakeApi``)."""

from __future__ import annotations

from types import SimpleNamespace

from cluster_run import OWNER, RUN_DIR, RUN_ID

from hetflow.cluster.backends.kubernetes import backend as k8s
from hetflow.cluster.backends.kubernetes import manifests as manifests
from hetflow.cluster.layout import run_slug
from hetflow.spec import parse_spec

# The restricted profile's lists (Kubernetes 1.33).
ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.ping_group_range",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}


SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


CONFINED = {"RuntimeDefault", "Localhost"}


def restricted_violations(pod_spec: dict) -> list[str]:
    """Every way a pod spec breaks the restricted Pod Security Standard, one line each; a container's
    securityContext overrides the pod's, as the kubelet applies them."""
    found = []
    pod = pod_spec.get("securityContext", {})
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(field):
            found.append(f"pod: {field}")
    for volume in pod_spec.get("volumes", []):
        if not set(volume) - {"name"} <= ALLOWED_VOLUMES:
            found.append(f"volume {volume['name']}: {sorted(set(volume) - {'name'})}")
    for sysctl in pod.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            found.append(f"pod: sysctl {sysctl['name']}")
    if pod.get("runAsUser") == 0:
        found.append("pod: runAsUser 0")
    containers = [
        *pod_spec.get("initContainers", []),
        *pod_spec.get("containers", []),
        *pod_spec.get("ephemeralContainers", []),
    ]
    for container in containers:
        where = f"container {container['name']}"
        own = container.get("securityContext", {})
        effective = {**pod, **own}
        if own.get("privileged"):
            found.append(f"{where}: privileged")
        if own.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}: allowPrivilegeEscalation not false")
        if effective.get("runAsNonRoot") is not True:
            found.append(f"{where}: runAsNonRoot not true")
        if own.get("runAsUser") == 0:
            found.append(f"{where}: runAsUser 0")
        if effective.get("seccompProfile", {}).get("type") not in CONFINED:
            found.append(f"{where}: seccompProfile not RuntimeDefault or Localhost")
        capabilities = own.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{where}: capabilities not dropping ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{where}: capabilities added {capabilities['add']}")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            found.append(f"{where}: hostPort")
        if own.get("procMount", "Default") != "Default":
            found.append(f"{where}: procMount {own['procMount']}")
        if effective.get("appArmorProfile", {}).get("type", "RuntimeDefault") not in CONFINED:
            found.append(f"{where}: appArmorProfile unconfined")
        selinux = effective.get("seLinuxOptions", {})
        if selinux.get("type") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            found.append(f"{where}: seLinuxOptions {selinux}")
        if effective.get("windowsOptions", {}).get("hostProcess"):
            found.append(f"{where}: windowsOptions.hostProcess")
    return found


def _specs():
    return {
        "parameter_server": parse_spec(
            {
                "backend": "kubernetes",
                "strategy": "parameter_server",
                "workers": 2,
                "ps": 1,
                "replica_cpus": 1,
                "replica_memory_mb": 2048,
                "request_gpus": True,
                "kubernetes_namespace": "ml",
            }
        ),
        "multi_worker_mirrored": parse_spec(
            {"backend": "kubernetes", "strategy": "multi_worker_mirrored", "workers": 2, "restart_policy": "on_failure"}
        ),
    }


def _pod_specs(spec) -> dict[str, dict]:
    """Every pod spec the backend renders for the spec: one per replica and the TFJob's templates."""
    layout = k8s.plan(spec, RUN_ID)
    pods = {
        f"pod {r.name}": manifests.replica_pod(layout, r, spec, RUN_DIR, OWNER, 12.5)["spec"] for r in layout.replicas
    }
    tfjob = manifests.tfjob_manifest(layout, spec, RUN_DIR)
    for kind, replicas in tfjob["spec"]["tfReplicaSpecs"].items():
        pods[f"tfjob {kind}"] = replicas["template"]["spec"]
    return pods


class _FakeApi:
    """Stands for CoreV1Api and NetworkingV1Api: records every call in one shared list; creates
    answer with a uid, lists with one object named after the run when selected by the run's label."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getattr__(self, method):
        def call(*args, **kwargs):
            self.calls.append((method, args, kwargs))
            if method.startswith("create_"):
                return SimpleNamespace(metadata=SimpleNamespace(name=args[1]["metadata"]["name"], uid="uid-1"))
            if method.startswith("list_"):
                selected = kwargs.get("label_selector") == f"{manifests.LABEL_RUN}={run_slug(RUN_ID)}"
                return SimpleNamespace(
                    items=[SimpleNamespace(metadata=SimpleNamespace(name="obj"))] if selected else []
                )

        return call

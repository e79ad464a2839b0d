"""The kubernetes backend's pods against the restricted Pod Security Standard, checked offline (no
cluster can run here, and kubernetes-validate checks the schema only): every pod the backend
renders, its own and the TFJob's templates, passes tests/kubernetes_pods.py's checks, which see each
violation. Also what the standard leaves out: no service-account token, numeric non-root ids, a
deadline. And the claim that holds HETFLOW_HOME: no fsGroup (the kubelet would open the whole claim
to the pods' group); the supervisor hands the pods their run directory instead, or the run is
refused before it starts."""

from __future__ import annotations

import copy
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml
from cluster_run import RUN_DIR, RUN_ID
from conftest import REPO
from kubernetes_pods import _FakeApi, _pod_specs, _specs, restricted_violations

from hetflow import sandbox
from hetflow.cluster.backends.kubernetes import backend as k8s
from hetflow.cluster.backends.kubernetes import manifests as manifests
from hetflow.spec import RunSpec

BIN = Path(sys.executable).parent


@pytest.mark.parametrize("strategy", list(_specs()))
def test_every_rendered_pod_meets_the_restricted_pod_security_standard(strategy):
    pods = _pod_specs(_specs()[strategy])
    assert {name: restricted_violations(pod) for name, pod in pods.items()} == {name: [] for name in pods}


def _compliant_pod() -> dict:
    pod = copy.deepcopy(_pod_specs(_specs()["parameter_server"])["pod chief-0"])
    assert restricted_violations(pod) == []
    return pod


def _container(pod):
    return pod["containers"][0].setdefault("securityContext", {})


def _init_container_without_context(pod):
    pod["initContainers"] = [{"name": "init", "image": "busybox"}]


# Each case breaks one rule of the standard in an otherwise compliant pod: the checker must see it.
VIOLATIONS = {
    "hostNetwork": lambda pod: pod.update(hostNetwork=True),
    "hostPID": lambda pod: pod.update(hostPID=True),
    "hostIPC": lambda pod: pod.update(hostIPC=True),
    "hostPath volume": lambda pod: pod["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    "unsafe sysctl": lambda pod: pod["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    "pod runs as root": lambda pod: pod["securityContext"].update(runAsUser=0),
    "privileged": lambda pod: _container(pod).update(privileged=True),
    "privilege escalation": lambda pod: _container(pod).update(allowPrivilegeEscalation=True),
    "privilege escalation unset": lambda pod: _container(pod).pop("allowPrivilegeEscalation"),
    "root allowed": lambda pod: _container(pod).update(runAsNonRoot=False),
    "container runs as root": lambda pod: _container(pod).update(runAsUser=0),
    "seccomp unconfined": lambda pod: _container(pod).update(seccompProfile={"type": "Unconfined"}),
    "seccomp unset": lambda pod: pod["securityContext"].pop("seccompProfile"),
    "capabilities kept": lambda pod: _container(pod).pop("capabilities"),
    "capability added": lambda pod: _container(pod)["capabilities"].update(add=["SYS_ADMIN"]),
    "hostPort": lambda pod: pod["containers"][0]["ports"][0].update(hostPort=2222),
    "procMount": lambda pod: _container(pod).update(procMount="Unmasked"),
    "apparmor unconfined": lambda pod: _container(pod).update(appArmorProfile={"type": "Unconfined"}),
    "selinux type": lambda pod: _container(pod).update(seLinuxOptions={"type": "spc_t"}),
    "windows hostProcess": lambda pod: _container(pod).update(windowsOptions={"hostProcess": True}),
    "init container": _init_container_without_context,
}


@pytest.mark.parametrize("violation", list(VIOLATIONS))
def test_the_checker_sees_each_violation(violation):
    pod = _compliant_pod()
    VIOLATIONS[violation](pod)
    assert restricted_violations(pod)


@pytest.mark.parametrize("strategy", list(_specs()))
def test_pods_mount_no_service_account_token_and_run_as_the_image_user(strategy):
    # Numeric ids: the kubelet can only verify runAsNonRoot for a numeric user.
    assert isinstance(manifests.IMAGE_USER, int) and manifests.IMAGE_USER > 0
    for name, pod in _pod_specs(_specs()[strategy]).items():
        assert pod["automountServiceAccountToken"] is False, name
        context = pod["securityContext"]
        assert context["runAsUser"] == context["runAsGroup"] == manifests.IMAGE_USER, name


@pytest.mark.parametrize("strategy", list(_specs()))
def test_pods_write_nowhere_but_their_output_folder_and_a_private_tmp(strategy):
    """As a docker container: the image's root file system read-only (a replica cannot rewrite the
    venv or the hetflow package that runs next), /tmp an emptyDir of the pod's own with a size limit,
    and HOME there; every other mount read-only."""
    for name, pod in _pod_specs(_specs()[strategy]).items():
        [container] = pod["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert container["securityContext"]["runAsNonRoot"] is True, name
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        writable = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"] if not m.get("readOnly")}
        assert set(writable) == {str(RUN_DIR / "replica_output"), "/tmp"}, name
        assert writable["/tmp"] == {"name": manifests.TMP_VOLUME, "emptyDir": {"sizeLimit": "512Mi"}}, name
        assert {"name": "HOME", "value": "/tmp"} in container["env"], name


def test_every_pod_carries_a_deadline_from_train_timeout_seconds():
    for timeout in (600, 7200):
        spec = RunSpec.from_values({**_specs()["parameter_server"].flat(), "train_timeout_seconds": timeout})
        deadlines = {name: pod["activeDeadlineSeconds"] for name, pod in _pod_specs(spec).items()}
        assert set(deadlines.values()) == {timeout + manifests.DEADLINE_MARGIN_SECONDS}, deadlines
        tfjob = manifests.tfjob_manifest(k8s.plan(spec, RUN_ID), spec, RUN_DIR)
        assert tfjob["spec"]["runPolicy"]["activeDeadlineSeconds"] == timeout + manifests.DEADLINE_MARGIN_SECONDS


# --- what the pods may do with the claim that holds HETFLOW_HOME ----------------------------------


@pytest.mark.parametrize("strategy", list(_specs()))
def test_no_pod_asks_the_kubelet_to_change_owners_or_modes_on_the_claim(strategy):
    """fsGroup makes the kubelet chgrp and open to the group the whole volume, not the mounted
    sub-paths; fsGroupChangePolicy only decides when; supplementalGroups would give the pods the
    group of whatever else the claim holds."""
    for name, pod in _pod_specs(_specs()[strategy]).items():
        context = pod["securityContext"]
        assert not {"fsGroup", "fsGroupChangePolicy", "supplementalGroups"} & set(context), (name, context)
        mounted = {m["subPath"] for c in pod["containers"] for m in c["volumeMounts"] if m["name"] == "hetflow-home"}
        run = str(RUN_DIR.relative_to(RUN_DIR.parents[1]))
        assert mounted == {run, f"{run}/replica_output"}, name


def test_the_pods_see_their_run_directory_read_only_and_write_only_their_output_folder(tmp_path):
    """The pipeline's records in the run directory (spec.json, dataset.json, cluster.json, and those it
    renames in later) are out of the pods' reach: the run directory is one read-only mount, from the
    claim, at the path it has on the supervisor, and the output folder the one read-write mount over
    it; the pods of tfjob.yaml too. What a replica planted there before is removed. The rendered pods
    still pass strict schema validation and the restricted standard."""
    home = tmp_path / "home"
    run_dir = home / "runs" / "r"
    (run_dir / "replica_output").mkdir(parents=True)
    for record in ("run_id", "spec.json", "cluster.json"):
        (run_dir / record).write_text("{}")
    (run_dir / "replica_output" / "training.json").symlink_to("/etc/shadow")  # an earlier try's replica's
    spec = _specs()["multi_worker_mirrored"]
    calls = []
    api = _FakeApi(calls)
    k8s.KubernetesReplicas(k8s.plan(spec, RUN_ID), spec, run_dir, core=api, networking=api).provision()

    assert not os.path.lexists(run_dir / "replica_output" / "training.json")
    pods = [args[1] for method, args, _ in calls if method == "create_namespaced_pod"]
    tfjob = next(yaml.safe_load_all((run_dir / "tfjob.yaml").read_text()))
    templates = [replicas["template"] for replicas in tfjob["spec"]["tfReplicaSpecs"].values()]
    for name, pod_spec in [
        *((pod["metadata"]["name"], pod["spec"]) for pod in pods),
        *((f"tfjob {t['spec']['containers'][0]['name']}", t["spec"]) for t in templates),
    ]:
        [container] = pod_spec["containers"]
        mounts = {m["mountPath"]: m for m in container["volumeMounts"] if m["mountPath"] != "/tmp"}
        assert mounts == {
            str(run_dir): {"name": "hetflow-home", "mountPath": str(run_dir), "subPath": "runs/r", "readOnly": True},
            str(run_dir / "replica_output"): {
                "name": "hetflow-home",
                "mountPath": str(run_dir / "replica_output"),
                "subPath": "runs/r/replica_output",
            },
        }, name
        assert restricted_violations(pod_spec) == [], name
    assert len(pods) == 2

    # The TFJob's templates, as the pods the operator makes of them.
    as_pods = [
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "t", **t["metadata"]}, "spec": t["spec"]}
        for t in templates
    ]
    manifest = tmp_path / "pods.yaml"
    manifest.write_text(yaml.safe_dump_all([*pods, *as_pods]))
    result = subprocess.run([BIN / "kubernetes-validate", "--strict", manifest], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _as_the_pods_uid(*argv: str) -> subprocess.CompletedProcess:
    as_pod = ["setpriv", f"--reuid={manifests.IMAGE_USER}", f"--regid={manifests.IMAGE_USER}", "--clear-groups"]
    return subprocess.run([*as_pod, *argv], capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the supervisor hands the run directory over as root")
def test_provisioning_gives_the_pods_uid_its_run_directory_and_nothing_else_of_the_home():
    """Without fsGroup the pods write only because the supervisor made their output folder (and its
    checkpoints) theirs; tried as their uid on real directories: writes there and reads the data
    succeed, the run directory's top, the stack's secrets, another run and the logs stay out of reach."""
    top = Path(tempfile.mkdtemp(prefix="hetflow-pods-"))  # pytest's tmp_path is root's alone
    os.chmod(top, 0o755)  # a pod reaches its mounts directly; here it goes through the parents
    try:
        home = top / "home"
        run_dir, other_run, stack, data = home / "runs" / "mine", home / "runs" / "other", home / "stack", home / "data"
        output = run_dir / "replica_output"
        for directory in (output / "checkpoints" / "earlier", other_run, stack, data):
            directory.mkdir(parents=True)
        (output / "checkpoints" / "earlier" / "ckpt-1.index").write_text("an earlier try's")
        (data / "shard").write_text("examples")
        (stack / "secrets.json").write_text("{}")
        stack.chmod(0o700)
        spec = _specs()["multi_worker_mirrored"]
        api = _FakeApi([])
        k8s.KubernetesReplicas(k8s.plan(spec, RUN_ID), spec, run_dir, core=api, networking=api).provision()

        pods = (manifests.IMAGE_USER, manifests.IMAGE_USER)
        for path in (output, output / "checkpoints", output / "checkpoints" / "earlier" / "ckpt-1.index"):
            assert (path.stat().st_uid, path.stat().st_gid) == pods, path
        untouched = [home, home / "runs", other_run, stack, stack / "secrets.json", data, data / "shard"]
        for path in [*untouched, run_dir, run_dir / "logs"]:
            assert (path.stat().st_uid, path.stat().st_gid) == (0, 0), path
        assert stat.S_IMODE(stack.stat().st_mode) == 0o700

        for target in (output / "training.json", output / "checkpoints" / "ckpt-2.index"):
            done = _as_the_pods_uid("touch", str(target))
            assert done.returncode == 0, done.stderr
        assert _as_the_pods_uid("cat", str(data / "shard")).stdout == "examples"
        refused_paths = (run_dir / "evaluation.json", stack / "secrets.json", other_run / "planted")
        for refused in (*refused_paths, run_dir / "logs" / "worker-0.log"):
            assert _as_the_pods_uid("touch", str(refused)).returncode != 0, refused
    finally:
        shutil.rmtree(top)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a directory over")
def test_preflight_passes_where_the_supervisor_can_give_the_pods_their_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HETFLOW_HOME", str(tmp_path / "home"))
    spec = _specs()["multi_worker_mirrored"]
    assert k8s.BACKEND.preflight(spec, RUN_ID) == []
    assert list((tmp_path / "home" / "runs").iterdir()) == []  # the scratch directory is gone


def test_preflight_refuses_a_supervisor_that_cannot_give_the_pods_their_run_directory(tmp_path):
    """As an unprivileged uid other than the pods' (the sandbox's nobody, where root runs this), the
    run is refused before anything starts, with one line naming the claim and what to do."""
    home = tmp_path / "home"
    (home / "runs").mkdir(parents=True)
    sandbox.hand_over(home / "runs")
    probe = textwrap.dedent(
        """
        from hetflow.cluster.backends.kubernetes import backend as k8s
        from hetflow.spec import parse_spec
        print(*k8s.BACKEND.preflight(parse_spec({"backend": "kubernetes", "kubernetes_volume_claim": "shared"}), "r"))
        """
    )
    box = sandbox.Sandbox(read_write=[str(home)])
    environment = {**os.environ, "HETFLOW_HOME": str(home), "PYTHONPATH": str(REPO)}
    try:
        done = subprocess.run(
            box.command([sys.executable, "-c", probe]),
            pass_fds=box.fds,
            env=environment,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        box.close()
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    assert line.startswith("kubernetes_volume_claim='shared': the pods run as uid 10001"), line
    assert line.endswith(
        f"run the Airflow tasks as root (on NFS, from an export without root_squash) or as uid {manifests.IMAGE_USER}"
    )
    assert list((home / "runs").iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop CAP_CHOWN")
def test_preflight_refuses_root_that_may_not_chown_as_on_nfs_with_root_squash(tmp_path):
    """Root without CAP_CHOWN stands for root on an NFS export with root_squash."""
    home = tmp_path / "home"
    probe = textwrap.dedent(
        """
        from hetflow.cluster.backends.kubernetes import backend as k8s
        from hetflow.spec import parse_spec
        print(*k8s.BACKEND.preflight(parse_spec({"backend": "kubernetes"}), "r"))
        """
    )
    done = subprocess.run(
        ["setpriv", "--inh-caps=-chown", "--bounding-set=-chown", sys.executable, "-c", probe],
        env={**os.environ, "HETFLOW_HOME": str(home), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    assert "this process (uid 0) cannot give them (Operation not permitted: " in line, line
    assert list((home / "runs").iterdir()) == []

"""What every container backend shares (hetflow/cluster/containers.py and the layouts they plan):
the local backend's roles and TF_CONFIG with named addresses, run slugs as DNS labels, the keys
only containers take, a worker's GPUs read from one place, unprivileged containers on a read-only
root, and replica logs written line by line without following a planted link."""

from __future__ import annotations

import json
import re

import pytest
from cluster_run import HOME, RUN_DIR, RUN_ID

from hetflow.cluster.backends.docker import backend as dk
from hetflow.cluster.backends.kubernetes import backend as k8s
from hetflow.cluster.containers import ReplicaLaunch, lines_to_file
from hetflow.cluster.layout import plan_cluster, run_slug
from hetflow.paths import RunPaths
from hetflow.spec import SpecError, parse_spec

DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


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
        "(CPU limits and GPU requests apply to backend=docker, swarm or kubernetes)"
        for key, value, off in (
            ("replica_cpus", "2.0", "0.0"),
            ("request_gpus", "true", "false"),
        )
    ]
    # Memory is limited on local too (hetflow.cluster.backends.local.limits): the key is read there.
    assert parse_spec({"replica_memory_mb": 512}).cluster.resources.memory_mb == 512
    with pytest.raises(SpecError, match=r"pin_cores=true is invalid with backend=kubernetes: expected false"):
        parse_spec({"backend": "kubernetes", "pin_cores": True})
    with pytest.raises(SpecError, match=r'kubernetes_namespace="Bad_NS" is invalid: expected a string matching'):
        parse_spec({"backend": "kubernetes", "kubernetes_namespace": "Bad_NS"})
    with pytest.raises(SpecError, match=r'backend="slurm" is invalid: expected one of local, docker, swarm, kube'):
        parse_spec({"backend": "slurm"})


# --- what a replica container gets, and its log ---------------------------------------------------


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
    config = dk.container_config(ReplicaLaunch(layout, layout.replicas[0], spec, HOME, RUN_DIR, "65534:65534", 0.0))
    assert config["cap_drop"] == ["ALL"] and config["security_opt"] == ["no-new-privileges"]
    assert config["read_only"] is True and "/tmp" in config["tmpfs"] and config["pids_limit"] == containers.PIDS_LIMIT
    # The run directory, its records included, read-only as a whole; only the output folder writable.
    output = str(RunPaths(RUN_DIR).output)
    assert config["volumes"][str(RUN_DIR)] == {"bind": str(RUN_DIR), "mode": "ro"}
    assert config["volumes"][output] == {"bind": output, "mode": "rw"}
    # Never root, even where the supervisor is: a uid of the run's own, not nobody's, another run's
    # another's.
    monkeypatch.setattr(containers.os, "geteuid", lambda: 0)
    users = {containers.container_user(RUN_DIR), containers.container_user(RUN_DIR.with_name("other-run"))}
    assert len(users) == 2 and "65534:65534" not in users and not any(user.startswith("0:") for user in users)


def test_container_replicas_own_their_output_folder_under_their_runs_uid_and_nothing_else(tmp_path):
    """Where root provisions, a container run's output folder is handed to the uid its containers
    run as (the run's own), and the run directory stays root's."""
    import os

    from hetflow.cluster import containers

    if os.geteuid() != 0:
        pytest.skip("hands folders over only where root provisions")
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    containers.prepare_run_dir(paths)
    uid, gid = map(int, containers.container_user(paths.root).split(":"))
    assert (paths.output.stat().st_uid, paths.output.stat().st_gid) == (uid, gid) != (65534, 65534)
    assert paths.root.stat().st_uid == 0


def test_log_chunks_become_lines_and_the_log_file(tmp_path):
    lines = lines_to_file([b"Epoch 1/", b"2\nloss 0.5\nEpo", b"ch 2/2"], tmp_path / "w.log")
    assert list(lines) == ["Epoch 1/2", "loss 0.5", "Epoch 2/2"]
    assert (tmp_path / "w.log").read_text() == "Epoch 1/2\nloss 0.5\nEpoch 2/2\n"


def test_a_replica_log_planted_as_a_link_is_not_followed(tmp_path):
    """A replica that put a link at its log's name (to a file of the pipeline's, say) gets its
    output refused, and the link's target stays untouched."""
    target = tmp_path / "secrets.json"
    target.write_text("{}")
    (tmp_path / "w.log").symlink_to(target)
    with pytest.raises(OSError):
        list(lines_to_file([b"line\n"], tmp_path / "w.log"))
    assert target.read_text() == "{}"

"""The docker backend (hetflow/cluster/backends/docker/backend.py): the run's network, each replica's container
config, a container's state from `docker inspect`, CPU quotas and cpusets."""

from __future__ import annotations

import os

from cluster_run import HOME, RUN_DIR, RUN_ID, ps_spec

from hetflow.cluster.backends.base import ReplicaState
from hetflow.cluster.backends.docker import backend as dk
from hetflow.cluster.containers import ReplicaLaunch
from hetflow.cluster.layout import run_slug
from hetflow.spec import RunSpec, parse_spec

# --- docker: network and container configs --------------------------------------------------------


def test_docker_network_is_internal_and_labelled_with_the_run():
    assert dk.network_config(RUN_ID, RUN_DIR) == {
        "name": f"hetflow-{run_slug(RUN_ID)}",
        "driver": "bridge",
        "internal": True,  # TF's gRPC servers listen on 0.0.0.0: nothing outside the run reaches them
        "options": {"com.docker.network.bridge.inhibit_ipv4": "true"},  # nor the host (test_security_docker_network)
        "labels": {"hetflow.run": run_slug(RUN_ID), "hetflow.run-id": RUN_ID, "hetflow.run-dir": str(RUN_DIR)},
    }


def test_docker_container_configs_carry_tf_config_labels_limits_and_gpus():
    spec = ps_spec("docker", replica_cpus=1.5, replica_memory_mb=2048, request_gpus=True, restart_policy="on_failure")
    layout = dk.plan(spec, RUN_ID)
    configs = {
        r.name: dk.container_config(ReplicaLaunch(layout, r, spec, HOME, RUN_DIR, "1000:1000", 12.5))
        for r in layout.replicas
    }
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
        # its own run directory read-only but for its output folder (a run without a prepared dataset
        # here: its data, read-only too, in test_security_data_view): nothing else of HETFLOW_HOME
        assert config["volumes"] == {
            str(RUN_DIR): {"bind": str(RUN_DIR), "mode": "ro"},
            str(RUN_DIR / "replica_output"): {"bind": str(RUN_DIR / "replica_output"), "mode": "rw"},
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
    config = dk.container_config(ReplicaLaunch(layout, layout.replicas[0], spec, HOME, RUN_DIR, "0:0", 0.0))
    assert not {"nano_cpus", "mem_limit", "device_requests"} & set(config)
    assert config["restart_policy"] == {"Name": "no"}
    # The container's own deadline: the keeper's attach timeout (600 s) plus train_timeout_seconds (3600 s).
    assert config["entrypoint"] == ["timeout", "--kill-after=10", "4200", "python", "-m", "hetflow.replica"]
    with_gpus = parse_spec({"backend": "docker", "strategy": "mirrored", "devices_per_worker": 2, "request_gpus": True})
    config = dk.container_config(ReplicaLaunch(layout, layout.replicas[0], with_gpus, HOME, RUN_DIR, "0:0", 0.0))
    assert config["device_requests"][0]["Count"] == 2


def test_docker_container_state_from_inspect():
    assert dk.replica_state({"State": {"Status": "running", "ExitCode": 0}}) == ReplicaState()
    assert dk.replica_state({"State": {"Status": "exited", "ExitCode": 137}}) == ReplicaState(137)
    assert dk.replica_state({"State": {"Status": "created", "ExitCode": 0}}) == ReplicaState()
    killed = dk.replica_state({"State": {"Status": "exited", "ExitCode": 137, "OOMKilled": True}})
    assert killed.exit_code == 137 and killed.note.startswith("ran out of memory")


def test_a_slower_worker_is_a_container_with_a_smaller_cpu_quota_and_pinning_is_a_cpuset():
    devices = [{"device": "cpu"}, {"device": "cpu", "slowdown": 2}]
    spec = parse_spec(
        {"backend": "docker", "strategy": "multi_worker_mirrored", "workers": 2, "worker_devices": devices}
    )
    layout = dk.plan(spec, RUN_ID)
    configs = [dk.container_config(ReplicaLaunch(layout, r, spec, HOME, RUN_DIR, "0:0", 0.0)) for r in layout.replicas]
    # half of one core, where replica_cpus is unset; the other worker is not limited
    assert [c.get("nano_cpus") for c in configs] == [None, 500_000_000]
    limited = RunSpec.from_values({**spec.flat(), "replica_cpus": 1.5, "pin_cores": True})
    configs = [
        dk.container_config(ReplicaLaunch(layout, r, limited, HOME, RUN_DIR, "0:0", 0.0)) for r in layout.replicas
    ]
    assert [c["nano_cpus"] for c in configs] == [1_500_000_000, 750_000_000]
    assert len({c["cpuset_cpus"] for c in configs}) == min(2, len(os.sched_getaffinity(0)))

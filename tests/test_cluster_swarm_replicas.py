"""backend=swarm's services without a swarm: what each replica's service is, where it is placed,
how its task's state and log lines are read, what the spec refuses, and preflight on an engine that
is in no swarm. Real runs on real nodes are in test_cluster_swarm_backend.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cluster_run import swarm_sync_spec

from hetflow.cluster import containers
from hetflow.cluster.backends.swarm.preflight import preflight, satisfies
from hetflow.cluster.backends.swarm.replicas import (
    _stamp_key,
    _stamp_seconds,
    network_config,
    placement,
    plan,
    service_config,
    task_state,
)
from hetflow.cluster.containers import ReplicaLaunch
from hetflow.cluster.layout import run_slug
from hetflow.spec import SpecError, parse_spec

# --- services, placement and states: pure ------------------------------------------------------------


def test_a_replica_service_is_one_task_by_dns_name_placed_by_node_and_restarted_only_by_the_supervisor():
    spec = swarm_sync_spec(replica_cpus=1.5, replica_memory_mb=512)
    layout = plan(spec, "manual__2026-11-25T10:00:00+00:00")
    worker = layout.replicas[1]
    config = service_config(ReplicaLaunch(layout, worker, spec, Path("/srv/h"), Path("/srv/h/runs/r"), "0:0", 1.0))
    assert worker.address == f"hetflow-{run_slug(layout.run_id)}-worker-1:2222" == f"{config['name']}:2222"
    assert config["endpoint_spec"]["Mode"] == "dnsrr"  # no virtual IP: the name resolves to the task
    assert config["restart_policy"]["Condition"] == "none"
    # Its supervisor's heartbeat ends it, not the lease: a flock over the nodes' NFS is not to be trusted.
    assert config["args"] == ["--run-dir", "/srv/h/runs/r", "--watch-supervisor", "heartbeat"]
    assert config["constraints"] == ["node.hostname==node-2"]
    assert config["mode"] == {"replicated": {"Replicas": 1}}
    resources = config["resources"]
    assert resources["Limits"] == {"NanoCPUs": 1_500_000_000, "MemoryBytes": 512 * 2**20, "Pids": 1024}
    assert resources["Reservations"] == {"NanoCPUs": 1_500_000_000, "MemoryBytes": 512 * 2**20}
    env = dict(entry.split("=", 1) for entry in config["env"])
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}
    assert config["labels"]["hetflow.run"] == run_slug(layout.run_id) and config["labels"]["hetflow.role"] == "worker"
    mounts = {m["Target"]: m.get("ReadOnly", False) for m in config["mounts"]}
    # The run directory read-only as a whole, only the replicas' output folder writable; no data is
    # shown before dataset.json names the run's own (tests/test_security_data_view.py).
    assert mounts == {"/srv/h/runs/r": True, "/srv/h/runs/r/replica_output": False, "/tmp": False}
    # Hardened as its docker container is (seen on a real node in test_a_replica_service_is_hardened_...).
    assert config["cap_drop"] == ["ALL"] and config["read_only"] is True
    assert config["command"][:2] == ["setpriv", "--no-new-privs"]
    assert resources["Limits"]["Pids"] == containers.PIDS_LIMIT
    tmp = {"Target": "/tmp", "Source": None, "Type": "tmpfs", "ReadOnly": False}
    assert {**tmp, "TmpfsOptions": {"SizeBytes": containers.TMP_BYTES}} in config["mounts"]
    network = network_config(layout.run_id, Path("/srv/h/runs/r"), encrypted=True)
    assert (network["driver"], network["attachable"], network["internal"]) == ("overlay", True, True)
    assert network["options"] == {"encrypted": "true"}


def test_placement_follows_the_device_label_or_the_named_node_and_gpus_are_generic_resources():
    spec = parse_spec(
        {
            "backend": "swarm",
            "strategy": "parameter_server",
            "workers": 2,
            "ps": 1,
            "request_gpus": True,
            "worker_devices": [{"device": "gpu"}, {"device": "cpu"}],
        }
    )
    layout = plan(spec, "r")
    by_name = {r.name: placement(spec, r) for r in layout.replicas}
    assert by_name == {
        "chief-0": [],
        "worker-0": ["node.labels.hetflow.device==gpu"],
        "worker-1": ["node.labels.hetflow.device!=gpu"],
        "ps-0": [],
    }
    gpu_node = {"Description": {"Hostname": "g"}, "Spec": {"Labels": {"hetflow.device": "gpu"}}}
    plain_node = {"Description": {"Hostname": "p"}, "Spec": {"Labels": {}}}
    assert [satisfies(n, by_name["worker-0"]) for n in (gpu_node, plain_node)] == [True, False]
    assert [satisfies(n, by_name["worker-1"]) for n in (gpu_node, plain_node)] == [False, True]
    assert satisfies(plain_node, ["node.hostname==p"]) and not satisfies(gpu_node, ["node.hostname==p"])
    worker = layout.replicas[1]
    config = service_config(ReplicaLaunch(layout, worker, spec, Path("/h"), Path("/h/runs/r"), "0:0", 1.0))
    assert config["resources"]["Reservations"]["GenericResources"] == [
        {"DiscreteResourceSpec": {"Kind": "NVIDIA-GPU", "Value": 1}}
    ]


@pytest.mark.parametrize(
    "status, expected",
    [
        ({"State": "running"}, (None, None)),
        ({"State": "complete", "ContainerStatus": {"ExitCode": 0}}, (0, None)),
        ({"State": "failed", "ContainerStatus": {"ExitCode": 137}}, (137, None)),
        ({"State": "orphaned"}, (-9, None)),  # its node is gone
        ({"State": "rejected", "Err": "No such image: x"}, (None, "No such image: x")),
    ],
)
def test_a_task_state_is_read_as_the_supervisor_reads_every_backend(status, expected):
    state = task_state({"Status": status})
    assert (state.exit_code, state.stuck) == expected


def test_swarm_only_settings_are_refused_elsewhere_and_swarm_refuses_pinning():
    with pytest.raises(SpecError, match=r"^worker_devices node is invalid with backend=docker: expected empty"):
        parse_spec(
            {
                "backend": "docker",
                "strategy": "multi_worker_mirrored",
                "workers": 2,
                "worker_devices": [{"node": "a"}, {"node": "b"}],
            }
        )
    with pytest.raises(SpecError, match=r"^pin_cores=true is invalid with backend=swarm: expected false"):
        swarm_sync_spec(pin_cores=True)
    with pytest.raises(SpecError, match=r"worker_devices\[0\]\.node=\"-x\" is invalid"):
        swarm_sync_spec(worker_devices=[{"node": "-x"}, {"node": "node-2"}])


def test_preflight_refuses_an_engine_that_is_not_in_a_swarm(docker_client):
    spec = swarm_sync_spec()
    [problem] = preflight(spec, "not-a-swarm", client=docker_client)  # `make test`'s engine: no swarm
    assert (
        problem.startswith("backend=swarm: the Docker engine of ") and "is not in a swarm: run `docker swarm" in problem
    )


def test_log_time_stamps_sort_as_times_and_the_engines_own_messages_are_not_output():
    # Docker drops trailing zeros of the fraction: as text, "...:17.1Z" would sort after "...:17.12Z".
    keys = [_stamp_key(s) for s in ("2026-11-25T14:10:17Z", "2026-11-25T14:10:17.1Z", "2026-11-25T14:10:17.12Z")]
    assert keys == sorted(keys) and len(set(keys)) == 3
    assert _stamp_key("grabbing") is None  # "grabbing logs: rpc error: ... node disconnected"
    assert _stamp_seconds(keys[2]) == 1795615817

"""backend=swarm on a real multi-node Docker Swarm — two nodes, each a container running its own
dockerd (docker/swarm.sh), one at 1.0 CPU and one at 0.5, joined and labelled, with the test's
HETFLOW_HOME mounted at the same path on both: preflight, hardening and reachability of the services,
real runs, a node lost. The services' configuration without a swarm: test_cluster_swarm_replicas.py."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
from cluster_run import swarm_sync_spec
from conftest import REPO, dag_run, full_log, wait_for
from network_probes import ANSWER, CONNECT, SERVE

from hetflow.cluster import containers
from hetflow.cluster.backends.swarm.backend import teardown_run
from hetflow.cluster.backends.swarm.preflight import preflight
from hetflow.cluster.backends.swarm.replicas import (
    network_config,
    plan,
    service_config,
)
from hetflow.cluster.containers import ReplicaLaunch
from hetflow.cluster.layout import SERVICE_PORT, run_slug
from hetflow.paths import RunPaths

PREFIX = "hetflow-swarm-test"
NODES = "node-1:1.0:cpu node-2:0.5:cpu"


@pytest.fixture(scope="module")
def swarm(docker_client, hetflow_env):
    """A swarm of two nodes on this machine (docker/swarm.sh up), the test's HETFLOW_HOME shared; the
    environment for hetflow to use it (DOCKER_HOST: the manager). Down at the end, leaving nothing."""
    import docker

    env = {**hetflow_env, "SWARM_PREFIX": PREFIX, "SWARM_NODES": NODES, "SWARM_SHARED": hetflow_env["HETFLOW_HOME"]}
    subprocess.run([REPO / "docker/build-image.sh"], check=True, capture_output=True)  # this checkout's code
    up = subprocess.run([REPO / "docker/swarm.sh", "up"], env=env, capture_output=True, text=True)
    assert up.returncode == 0, up.stdout + up.stderr
    docker_host = up.stdout.strip().splitlines()[-1].split("=", 1)[1]
    try:
        yield {"env": {**hetflow_env, "DOCKER_HOST": docker_host}, "client": docker.DockerClient(base_url=docker_host)}
    finally:
        down = subprocess.run([REPO / "docker/swarm.sh", "down"], env=env, capture_output=True, text=True)
        assert down.returncode == 0, down.stdout + down.stderr
        left = docker_client.containers.list(all=True, filters={"label": f"hetflow.swarm={PREFIX}"})
        assert left == [] and docker_client.volumes.list(filters={"name": PREFIX}) == []


def _kernel_lacks_esp() -> bool:
    config = Path("/proc/config.gz")
    if not config.exists():
        return False
    import gzip

    return not any(line.startswith(("CONFIG_INET_ESP=y", "CONFIG_INET_ESP=m")) for line in gzip.open(config, "rt"))


def _run_objects(client, run_id: str) -> list[str]:
    selector = {"label": f"hetflow.run={run_slug(run_id)}"}
    return sorted(s.name for s in client.services.list(filters=selector)) + sorted(
        n.name for n in client.networks.list(filters=selector)
    )


@pytest.mark.slow
@pytest.mark.heavy
def test_preflight_on_the_swarm_names_each_node_that_lacks_what_the_run_needs(swarm, monkeypatch, tmp_path):
    for key, value in swarm["env"].items():
        monkeypatch.setenv(key, value)
    assert preflight(swarm_sync_spec(), "preflight-run") == []
    assert preflight(swarm_sync_spec(image="hetflow-replica:missing"), "preflight-run") == [
        f"node {node} does not have image=hetflow-replica:missing: load it there (docker save | docker load) "
        "or push it to a registry the nodes pull from"
        for node in ("node-1", "node-2")
    ]
    [unplaced] = preflight(swarm_sync_spec(worker_devices=[{"node": "node-1"}, {"node": "node-9"}]), "preflight-run")
    assert unplaced.startswith(
        "worker_devices[1].node=node-9: no ready, active node of the swarm fits node.hostname==node-9 "
        "(nodes: node-1, node-2)"
    )
    if _kernel_lacks_esp():  # an encrypted overlay would drop every packet between the nodes
        assert preflight(swarm_sync_spec(encrypt_network=True), "preflight-run") == [
            f"node {node}: its kernel has no IPsec ESP (CONFIG_INET_ESP), so encrypt_network=true cannot carry "
            "traffic between the nodes: set encrypt_network=false where the nodes share a private network"
            for node in ("node-1", "node-2")
        ]
    [gpu] = preflight(swarm_sync_spec(worker_devices=[{"device": "gpu"}, {"node": "node-2"}]), "preflight-run")
    assert gpu.startswith("worker_devices[0].device=gpu: no ready, active node of the swarm fits")
    # A HETFLOW_HOME that the nodes do not mount (here: a directory only this machine has).
    monkeypatch.setenv("HETFLOW_HOME", str(tmp_path))
    assert preflight(swarm_sync_spec(), "preflight-run") == [
        f"node {node} does not mount HETFLOW_HOME={tmp_path}: mount the shared storage there at the same path"
        for node in ("node-1", "node-2")
    ]
    node_2 = f"unix:///run/{PREFIX}/node-2/docker.sock"
    monkeypatch.setenv("DOCKER_HOST", node_2)
    [worker] = preflight(swarm_sync_spec(), "preflight-run")
    assert worker.startswith("backend=swarm: node-2 is a swarm worker, not a manager")
    assert [s.name for s in swarm["client"].services.list()] == []  # the checks left no service


# A hostile replica in its service: it tries to gain privileges, plant code in the image, fork bomb.
PROBE = """
import errno, json, os, signal
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
root = "written"
try:
    open("/opt/venv/planted.py", "w")
except OSError as error:
    root = errno.errorcode[error.errno]
children, refused = [], None
while len(children) < 2000 and not refused:
    try:
        children.append(os.fork() or signal.pause())
    except OSError as error:
        refused = errno.errorcode[error.errno]
[os.kill(child, signal.SIGKILL) for child in children]
print(json.dumps([status["NoNewPrivs"].strip(), int(status["CapEff"], 16), root, len(children), refused]), flush=True)
signal.pause()
"""


@pytest.mark.slow
@pytest.mark.heavy
def test_a_replica_service_is_hardened_as_its_container(swarm):
    """The service config's command chain (setpriv, timeout) with the probe in the replica's place,
    on a node of Debian's Docker 20.10: no privilege to gain, no capability, a read-only image, a
    bounded process count."""
    spec, home = swarm_sync_spec(), Path(swarm["env"]["HETFLOW_HOME"])
    layout, run_dir = plan(spec, "hardened-run"), home / "runs" / "hardened-run"
    RunPaths(run_dir).output.mkdir(parents=True, exist_ok=True)  # as provisioning makes it: the service mounts it
    client = swarm["client"]
    client.networks.create(**network_config(layout.run_id, run_dir, encrypted=False))
    config = service_config(ReplicaLaunch(layout, layout.replicas[0], spec, home, run_dir, "65534:65534", 0.0))
    config.update(command=[*config["command"][:-3], "python", "-c", PROBE], args=[])
    try:
        service = client.services.create(**config)
        output = wait_for(lambda: b"".join(service.logs(stdout=True, stderr=True)).decode(), timeout=240)
        no_new_privs, capabilities, root, forked, refused = json.loads(output.splitlines()[0])
        assert (no_new_privs, capabilities, root, refused) == ("1", 0, "EROFS", "EAGAIN"), output
        assert containers.PIDS_LIMIT - 10 < forked < containers.PIDS_LIMIT, output
    finally:
        teardown_run(layout.run_id, client)


@pytest.mark.slow
@pytest.mark.heavy
def test_a_replicas_port_is_reached_by_its_peer_on_another_node_and_by_nothing_on_the_nodes(swarm):
    """The attack of test_security_docker_network.py on a swarm: a server on worker-1's port in its
    service on node-2 answers worker-0's service on node-1 (by name, as TF_CONFIG addresses it), and
    no process of either node, root or another user, gets its answer: the run's overlay is internal,
    so its tasks have no leg on the node's docker_gwbridge and the node no route to them."""
    import docker

    spec, home = swarm_sync_spec(), Path(swarm["env"]["HETFLOW_HOME"])
    layout, run_dir = plan(spec, "reach-run"), home / "runs" / "reach-run"
    RunPaths(run_dir).output.mkdir(parents=True, exist_ok=True)
    client = swarm["client"]
    network = client.networks.create(**network_config(layout.run_id, run_dir, encrypted=False))

    def service(replica, *argv: str):
        config = service_config(ReplicaLaunch(layout, replica, spec, home, run_dir, "65534:65534", 0.0))
        config.update(command=[*config["command"][:-3], "python", "-c", *argv], args=[])
        return client.services.create(**config)

    def logs(of) -> str:
        return b"".join(of.logs(stdout=True, stderr=True)).decode()

    try:
        worker_0, worker_1 = layout.replicas[:2]
        server = service(worker_1, SERVE)
        assert wait_for(lambda: "listening" in logs(server), timeout=240), logs(server)
        [task] = [t for t in server.tasks() if t["Status"]["State"] == "running"]
        overlay = [a["Addresses"][0] for a in task["NetworksAttachments"] if a["Network"]["ID"] == network.id]
        # Where a task also has a leg on its node's docker_gwbridge (a non-internal overlay), the node reaches it there.
        home_node = client.nodes.get(task["NodeID"]).attrs["Description"]["Hostname"]
        bridge = docker.DockerClient(base_url=f"unix:///run/{PREFIX}/{home_node}/docker.sock").networks.get(
            "docker_gwbridge"
        )
        legs = [endpoint["IPv4Address"] for endpoint in bridge.attrs["Containers"].values()]
        addresses = [address.split("/")[0] for address in overlay + legs]
        peer = service(worker_0, CONNECT, server.name, str(SERVICE_PORT))
        assert wait_for(lambda: logs(peer).strip(), timeout=240) == ANSWER, logs(peer)
        for node in ("node-1", "node-2"):
            for as_user, address in itertools.product(
                ([], ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]), addresses
            ):
                reply = subprocess.run(
                    [
                        "docker",
                        "exec",
                        f"{PREFIX}-{node}",
                        *as_user,
                        "python3",
                        "-c",
                        CONNECT,
                        address,
                        str(SERVICE_PORT),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert reply.returncode == 0 and ANSWER not in reply.stdout, (node, as_user, address, reply)
    finally:
        teardown_run(layout.run_id, client)


# Enough epochs for the MLP to pass the local backend's bar (tests/test_e2e_run.py); no pruning or
# quantization, which have nothing to do with where the replicas ran.
TRAINING = ("epochs=15", "prune=false", "quantize=none", "backend=swarm", "encrypt_network=false")


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize(
    "shape",
    [
        ("strategy=multi_worker_mirrored", "workers=2"),
        ("strategy=parameter_server", "workers=2", "ps=1"),
        ("strategy=model_parallel", "workers=2"),
    ],
    ids=["sync", "async", "stages"],
)
def test_a_dag_run_across_two_swarm_nodes_reaches_the_local_bar_records_its_nodes_and_leaves_nothing(swarm, shape):
    devices = '[{"node": "node-1"}, {"node": "node-2"}]'
    done, summary = dag_run(
        swarm["env"], *TRAINING, *shape, f"worker_devices={devices}", "registered_model=swarm-digits", timeout=1200
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert summary["status"] == "success" and summary["restarts"] == []
    assert summary["metrics"]["test_accuracy"] >= 0.9
    nodes = summary["nodes"]
    assert (nodes["worker-0"], nodes["worker-1"]) == ("node-1", "node-2")
    assert "worker-0 on node-1, worker-1 on node-2" in done.stdout  # the terminal's summary says where
    assert set(nodes.values()) <= {"node-1", "node-2"}
    if "ps=1" in shape:
        assert set(nodes) == {"chief-0", "worker-0", "worker-1", "ps-0"}
    if "strategy=model_parallel" in shape:  # which node holds which layers
        stages = summary["stage_split"]["stages"]
        assert [(stage["replica"], stage["node"]) for stage in stages] == [
            ("worker-0", "node-1"),
            ("worker-1", "node-2"),
        ]
        assert all(stage["layers"] for stage in stages)
    chief = "chief-0" if "ps=1" in shape or "strategy=model_parallel" in shape else "worker-0"
    assert f"[{chief}] Epoch 15/15" in done.stdout  # the services' output streamed into the task log
    assert _run_objects(swarm["client"], summary["run_id"]) == []
    assert os.path.exists(Path(summary["run_dir"]) / "logs" / "worker-1.log")


def _kill_node_when(docker_client, run_dir_of, log_line: str, killed: list) -> None:
    """`docker kill` node-2 (not the manager: with one manager the swarm's API dies with it) once
    the worker it runs has written ``log_line``; records (node, replica)."""

    def ready():
        run_dir = run_dir_of()
        if run_dir is None or not RunPaths(run_dir).nodes.exists():
            return None
        on_node_2 = [name for name, node in json.loads(RunPaths(run_dir).nodes.read_text()).items() if node == "node-2"]
        log = run_dir / "logs" / f"{on_node_2[0]}.log" if on_node_2 else None
        return log is not None and log.exists() and log_line in log.read_text() and on_node_2[0]

    victim = wait_for(ready, timeout=900, interval=0.5)
    if victim:
        docker_client.containers.get(f"{PREFIX}-node-2").kill()
        killed.append(("node-2", victim))


def _revive(docker_client, swarm, node: str) -> None:
    """Start a killed node container again and wait until the swarm has it ready (it rejoins by itself)."""
    docker_client.containers.get(f"{PREFIX}-{node}").start()

    def states():
        return {n.attrs["Description"]["Hostname"]: n.attrs["Status"]["State"] for n in swarm["client"].nodes.list()}

    assert wait_for(lambda: states().get(node) == "ready", timeout=120), states()


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("policy", ["never", "on_failure"])
def test_a_node_killed_mid_run_fails_it_naming_the_node_or_places_its_replicas_again(
    docker_client, swarm, policy, tmp_path
):
    """Workers placed by label (not by name), so that after the node is gone the swarm can place
    them on the other one; node-2 is killed, whichever worker it runs."""
    home = Path(swarm["env"]["HETFLOW_HOME"]) / "runs"
    before = set(home.iterdir()) if home.exists() else set()

    def run_dir_of():
        new = set(home.iterdir()) - before if home.exists() else set()
        return next(iter(new), None)

    killed: list[str] = []
    killer = threading.Thread(target=_kill_node_when, args=(docker_client, run_dir_of, "Epoch 3/", killed), daemon=True)
    killer.start()
    try:
        done, summary = dag_run(
            swarm["env"],
            *TRAINING,
            "strategy=multi_worker_mirrored",
            "workers=2",
            f"restart_policy={policy}",
            "registered_model=swarm-killed",
            timeout=1200,
        )
        killer.join(timeout=10)
        assert killed, "no node was killed"
        [(node, victim)] = killed
        if policy == "never":
            assert done.returncode != 0 and summary["status"] == "failed"
            assert summary["failed_stage"] == "train"
            assert f"replica {victim} killed by SIGKILL (its node {node} went down)" in full_log(done)
        else:
            assert done.returncode == 0, done.stdout[-3000:]
            assert summary["status"] == "success" and summary["metrics"]["test_accuracy"] >= 0.9
            [restart] = summary["restarts"]
            assert restart["replica"] == victim and restart["action"] == "restarted every replica"
            assert restart["cause"].startswith(f"killed by SIGKILL (its node {node} went down)")
            assert set(json.loads(RunPaths(Path(summary["run_dir"])).nodes.read_text()).values()) == {"node-1"}
        assert _run_objects(swarm["client"], summary["run_id"]) == []  # nothing of the run on any node
    finally:
        for name, _ in killed:
            _revive(docker_client, swarm, name)

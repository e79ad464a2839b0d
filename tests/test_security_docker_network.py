"""The docker backend's network against whoever is on the host: a replica's gRPC port (TF's servers
listen on 0.0.0.0 and run graph ops for whoever connects) is reached by the run's other containers
and by nothing on the host, its root or its other users. Tried on the engine `make test` starts, as
the attack: a server on the replica's port in a container of the run, a connection from the host."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys

from conftest import wait_for
from network_probes import ANSWER, CONNECT, SERVE

from hetflow import sandbox
from hetflow.cluster.backends.docker import backend as dk
from hetflow.cluster.layout import SERVICE_PORT

RUN_ID = "network-attack"


def _container(client, name: str, argv: list[str], run_dir):
    """A container of the run, as the backend makes a replica's: its network, its labels, no
    capabilities, the supervisor's unprivileged uid."""
    return client.containers.run(
        image="hetflow-replica:0.1.0",
        entrypoint=["python", "-c", *argv],
        name=dk.container_name(RUN_ID, name),
        hostname=dk.container_name(RUN_ID, name),
        network=dk.network_name(RUN_ID),
        labels=dk.run_labels(RUN_ID, run_dir),
        user=f"{sandbox.SANDBOX_UID}:{sandbox.SANDBOX_GID}",
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        detach=True,
    )


def _from_the_host(address: str, uid: int | None) -> str:
    """The connection tried by a process on the host, as ``uid`` (another local user) or as this one."""
    as_user = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
    done = subprocess.run(
        [*as_user, sys.executable, "-c", CONNECT, address, str(SERVICE_PORT)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.stdout.strip() + done.stderr.strip()


def test_a_replicas_port_is_reached_by_the_run_and_by_nothing_on_the_host(docker_client, tmp_path):
    network = docker_client.networks.create(**dk.network_config(RUN_ID, tmp_path))
    try:
        server = _container(docker_client, "worker-0", [SERVE], tmp_path)
        assert wait_for(lambda: b"listening" in server.logs(), timeout=60), server.logs()
        server.reload()
        address = server.attrs["NetworkSettings"]["Networks"][network.name]["IPAddress"]
        subnet = ipaddress.ip_network(network.attrs["IPAM"]["Config"][0]["Subnet"])
        assert ipaddress.ip_address(address) in subnet

        # The run's other replica reaches it by name, as TF_CONFIG addresses it.
        peer = _container(docker_client, "worker-1", [CONNECT, server.name, str(SERVICE_PORT)], tmp_path)
        assert peer.wait(timeout=60)["StatusCode"] == 0
        assert peer.logs().decode().strip() == ANSWER

        # The host holds no address on the run's bridge, so it has no route to the replicas.
        words = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout.split()
        host = [ipaddress.ip_interface(words[i + 1]).ip for i, word in enumerate(words) if word == "inet"]
        assert host and not [ip for ip in host if ip in subnet], host
        other_user = sandbox.SANDBOX_UID if os.geteuid() == 0 else None
        for uid in {other_user, None}:
            reply = _from_the_host(address, uid)
            assert reply.startswith("refused:"), (uid, reply)
    finally:
        dk.teardown_run(RUN_ID, docker_client)

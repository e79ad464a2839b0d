"""The swarm backend's preflight: what would stop a run's services from starting, found before
anything starts (``preflight``), down to a one-shot check on each node the run may use
(``check_nodes``)."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import docker
from docker.types import Mount, RestartPolicy, ServiceMode

from hetflow.cluster.backends.swarm.replicas import ENDED, LABEL_DEVICE, newest_task, placement, plan
from hetflow.cluster.containers import container_user
from hetflow.cluster.engine import engine_client, run_filter, run_labels, source_digest
from hetflow.paths import hetflow_home, run_paths
from hetflow.spec import RunSpec

LABEL_CHECK = "hetflow.check"  # preflight's one-shot services
CHECK_TIMEOUT_SECONDS = 120.0
# Whether the node's kernel can do IPsec ESP, which an encrypted overlay needs: without it the
# network is created and then drops every packet between nodes (a kernel without CONFIG_INET_ESP).
# Kernels that do not publish their configuration say nothing, and the run goes ahead.
_ESP_CHECK = (
    "if [ -r /proc/config.gz ]; then "
    "if zcat /proc/config.gz | grep -qE '^CONFIG_INET_ESP=(y|m)'; then echo esp=yes; else echo esp=no; fi; fi"
)


def satisfies(node: dict, constraints: list[str]) -> bool:
    """Whether a node (``docker node inspect``'s attributes) meets constraints made by ``placement``."""
    labels = node["Spec"].get("Labels") or {}
    for constraint in constraints:
        negated = "!=" in constraint
        key, value = constraint.split("!=" if negated else "==", 1)
        if key == "node.hostname":
            actual = node["Description"]["Hostname"]
        else:
            actual = labels.get(key.removeprefix("node.labels."))
        if (actual == value) == negated:
            return False
    return True


def check_nodes(client, spec: RunSpec, run_id: str, nodes: list[dict], home: Path) -> list[str]:
    """On each node, a one-shot service of the replica image that reads a file just written under
    HETFLOW_HOME, prints the image's source digest and whether the kernel has IPsec ESP: one line
    for each node without the image, with another code's image, without the shared path, or (with
    ``encrypt_network``) whose kernel says it cannot encrypt."""
    token = secrets.token_hex(8)
    marker = home / ".swarm-check" / token
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(token)
    # The run's labels, with the directory the run will have: an interrupted check is swept as its run.
    labels = {**run_labels(run_id, run_paths(run_id).root), LABEL_CHECK: token}
    services = {}
    try:
        for node in nodes:
            hostname = node["Description"]["Hostname"]
            services[hostname] = client.services.create(
                spec.cluster.image,
                # Confined as the replicas are (replicas.service_config), which also checks that
                # the image has the setpriv they start with.
                command=["setpriv", "--no-new-privs", "sh", "-c"]
                + [f'echo "digest=$HETFLOW_SOURCE_DIGEST"; {_ESP_CHECK}; cat {marker}'],
                cap_drop=["ALL"],
                read_only=True,
                name=f"hetflow-check-{token}-{node['ID'][:12]}",
                labels=labels,
                user=container_user(run_paths(run_id).root),
                # The marker's folder alone: as the replicas, the check sees only what it is shown.
                mounts=[Mount(str(marker.parent), str(marker.parent), type="bind", read_only=True)],
                restart_policy=RestartPolicy(condition="none"),
                constraints=[f"node.id=={node['ID']}"],
                mode=ServiceMode("replicated", replicas=1),
            )
        deadline = time.monotonic() + CHECK_TIMEOUT_SECONDS
        results = {}
        while len(results) < len(services) and time.monotonic() < deadline:
            for hostname, service in services.items():
                task = newest_task(client, service.name)
                if hostname not in results and task and task["Status"]["State"] in ENDED:
                    results[hostname] = (task, b"".join(service.logs(stdout=True, stderr=True)).decode())
            time.sleep(0.3)
        return [_node_problem(hostname, spec, token, home, *results.get(hostname, (None, ""))) for hostname in services]
    finally:
        for service in services.values():
            service.remove()
        marker.unlink(missing_ok=True)


def _node_problem(hostname: str, spec: RunSpec, token: str, home: Path, task: dict | None, output: str) -> str:
    if task is None:
        return f"node {hostname}: its check did not finish within {CHECK_TIMEOUT_SECONDS:.0f} s"
    error = task["Status"].get("Err") or ""
    if "No such image" in error or "image" in error.lower() and "not" in error.lower():
        return (
            f"node {hostname} does not have image={spec.cluster.image}: load it there (docker save | docker load) "
            "or push it to a registry the nodes pull from"
        )
    if "bind source path does not exist" in error or "mount" in error.lower():
        return f"node {hostname} does not mount HETFLOW_HOME={home}: mount the shared storage there at the same path"
    if error:
        return f"node {hostname}: the image check failed: {error}"
    digest = next((line[len("digest=") :] for line in output.splitlines() if line.startswith("digest=")), "")
    if digest != source_digest():
        return (
            f"node {hostname} has image={spec.cluster.image} built from other code than this checkout (source digest "
            f"{digest[:12] or 'none'}, checkout {source_digest()[:12]}): rebuild it (make image) and load it there"
        )
    if spec.cluster.swarm.encrypt_network and "esp=no" in output.splitlines():
        return (
            f"node {hostname}: its kernel has no IPsec ESP (CONFIG_INET_ESP), so encrypt_network=true cannot carry "
            "traffic between the nodes: set encrypt_network=false where the nodes share a private network"
        )
    if token not in output:
        return f"node {hostname} sees another HETFLOW_HOME={home} than this one: mount the same shared storage there"
    return ""


def preflight(spec: RunSpec, run_id: str, client=None) -> list[str]:
    """What would stop the run's services from starting, one line each, before anything starts:
    no swarm, not a manager, a placement no node satisfies, a node without the image of this code
    or without the shared HETFLOW_HOME."""
    try:
        client = client or engine_client()
        info = client.info()
    except docker.errors.DockerException as error:
        reason = str(error).splitlines()[0][:200]
        return [f"backend=swarm: no Docker engine answers ({reason}); set DOCKER_HOST to a swarm manager's engine"]
    swarm = info.get("Swarm") or {}
    if swarm.get("LocalNodeState") != "active":
        return [
            f"backend=swarm: the Docker engine of {info.get('Name')} is not in a swarm: run `docker swarm init` on "
            "it and `docker swarm join` on the other machines, or use backend=docker"
        ]
    if not swarm.get("ControlAvailable"):
        return [
            f"backend=swarm: {info.get('Name')} is a swarm worker, not a manager: point DOCKER_HOST at a manager's "
            "engine (`docker node ls` on a manager lists them)"
        ]
    problems = []
    taken = client.services.list(filters=run_filter(run_id))
    if taken:
        problems.append(
            f"run {run_id} already has services on the swarm ({', '.join(sorted(s.name for s in taken))}): a run "
            "with this id is running or was not torn down; use another run id, or tear it down"
        )
    ready = [
        node.attrs
        for node in client.nodes.list()
        if node.attrs["Status"]["State"] == "ready" and node.attrs["Spec"]["Availability"] == "active"
    ]
    names = ", ".join(sorted(n["Description"]["Hostname"] for n in ready))
    used: dict[str, dict] = {}
    for replica in plan(spec, run_id).replicas:
        constraints = placement(spec, replica)
        fitting = [node for node in ready if satisfies(node, constraints)]
        if not fitting:
            device = spec.cluster.worker_device(replica.index)
            key = f"worker_devices[{replica.index}]"
            wanted = f"{key}.node={device.node}" if device.node else f"{key}.device={device.device}"
            problems.append(
                f"{wanted}: no ready, active node of the swarm fits {' and '.join(constraints)} (nodes: {names}); "
                f"label one (docker node update --label-add {LABEL_DEVICE}=...) or change the spec"
            )
        used.update({node["ID"]: node for node in fitting})
    if used and not problems:
        problems += [line for line in check_nodes(client, spec, run_id, list(used.values()), hetflow_home()) if line]
    return problems

"""The run's network namespace: where a run's replicas listen when provisioning runs as root, with
only loopback up, so that they reach each other on its 127.0.0.1 and nothing outside reaches them
(TensorFlow's gRPC servers listen on every interface, unauthenticated)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from tasks.paths import hetflow_home

log = logging.getLogger("hetflow.cluster")

NETNS_DIR = Path("/run/netns")  # where `ip netns` names namespaces


def namespace_name(run_id: str, home: Path) -> str:
    """The run's network namespace: a hash of its HETFLOW_HOME and id (two homes may hold one id),
    20 characters, which `ip netns` takes as a file name."""
    return "hetflow-" + hashlib.sha256(f"{home}\0{run_id}".encode()).hexdigest()[:12]


def isolate_network(run_id: str) -> dict:
    """A fresh network namespace for the run's replicas, with only loopback up: ``{"isolated": true,
    "namespace": NAME}``; or ``{"isolated": false, "reason": ...}`` (and a warning) where none can be
    had: creating one takes root and iproute2."""
    ip, nsenter = shutil.which("ip"), shutil.which("nsenter")
    if os.geteuid() != 0:
        return _not_isolated(run_id, "not running as root, which `ip netns add` needs")
    if ip is None or nsenter is None:
        return _not_isolated(run_id, "no `ip` (iproute2) or `nsenter` (util-linux) command on PATH")
    name = namespace_name(run_id, hetflow_home())
    # One left by an earlier provisioning of the run goes: a fresh namespace has every port free.
    delete_namespace(name)
    for command in (["netns", "add", name], ["-n", name, "link", "set", "lo", "up"]):
        done = subprocess.run([ip, *command], capture_output=True, text=True)
        if done.returncode != 0:
            delete_namespace(name)
            return _not_isolated(run_id, f"`ip {' '.join(command)}` failed: {done.stderr.strip()}")
    log.info("replicas of %s run in network namespace %s, unreachable from outside it", run_id, name)
    return {"isolated": True, "namespace": name}


def _not_isolated(run_id: str, reason: str) -> dict:
    log.warning(
        "replicas of %s listen on every interface of this host, without authentication (%s): "
        "firewall their ports or use backend=docker",
        run_id,
        reason,
    )
    return {"isolated": False, "reason": reason}


def namespace_processes(name: str) -> list[int]:
    """Pids of every live process in the named network namespace (what `ip netns pids` lists)."""
    try:
        namespace = os.stat(NETNS_DIR / name)
    except OSError:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            net = os.stat(entry / "ns" / "net")
        except OSError:
            continue
        if (net.st_dev, net.st_ino) == (namespace.st_dev, namespace.st_ino):
            pids.append(int(entry.name))
    return pids


def delete_namespace(name: str) -> None:
    """Remove the namespace's name; the kernel frees it once no process is left in it."""
    if (NETNS_DIR / name).exists():
        done = subprocess.run(["ip", "netns", "delete", name], capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("could not delete network namespace %s: %s", name, done.stderr.strip())

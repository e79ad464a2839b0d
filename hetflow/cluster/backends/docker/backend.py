"""Docker backend: one container per replica, on a network of the run's own.

Each replica is a container of the replica image running the same entry point as a local replica
(``python -m hetflow.replica --run-dir DIR``) with the same TF_CONFIG; its peers are addressed by
container name (Docker's embedded DNS resolves names on a user-defined network). TensorFlow's gRPC
servers listen on every interface, so the network is ``internal`` (no route out, no published port)
and its bridge has no address on the host (``network_config``): the host and its other users cannot
connect to a replica, which the containers of the run still reach on the bridge. Every container
and the network carry the run's labels, so teardown finds them by run id whatever started them.

The configs are built by pure functions (``network_config``, ``container_config``) and passed to
the Docker SDK as they are; ``DockerReplicas`` only starts, inspects and stops containers for the
one supervisor (``hetflow.cluster.supervisor``). A worker's slowdown is a CPU quota on its container.

A replica mounts its run directory (read-only, but for its output folder: read-write) and the prepared
data (read-only) at the same paths as on the supervisor, so the supervisor and the Docker engine must
share a filesystem (the engine runs on the Airflow worker's host, or the compose stack's volume).
Nothing else of HETFLOW_HOME is visible to it.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker  # the Docker SDK (its docker.errors comes with it)

from hetflow.cluster.backends.base import Backend, ReplicaState
from hetflow.cluster.containers import (
    PIDS_LIMIT,
    STOP_GRACE_SECONDS,
    TMP_BYTES,
    ReplicaLaunch,
    lines_to_file,
    replica_environment,
    replica_spec,
)
from hetflow.cluster.engine import (
    LABEL_INDEX,
    LABEL_ROLE,
    LABEL_RUN,
    LABEL_RUN_DIR,
    LABEL_RUN_ID,
    LABEL_SOURCE,
    EngineReplicas,
    container_name,
    engine_client,
    network_name,
    run_filter,
    run_labels,
    source_digest,
)
from hetflow.cluster.layout import ClusterLayout, Replica, core_assignment, plan_named_cluster
from hetflow.cluster.lease import ATTACH_TIMEOUT_SECONDS
from hetflow.cluster.output_lines import cut_lines
from hetflow.cluster.replica_view import replica_view
from hetflow.cluster.usage import ContainerUsage
from hetflow.spec import RunSpec

log = logging.getLogger("hetflow.cluster")


def plan(spec: RunSpec, run_id: str) -> ClusterLayout:
    return plan_named_cluster(spec, run_id, lambda name: container_name(run_id, name))


def network_config(run_id: str, run_dir: Path) -> dict:
    """Keyword arguments of ``client.networks.create``. ``internal`` alone still gives the bridge the
    subnet's gateway address on the host (Docker 20.10 and current), and with it a route by which any
    local user reaches the replicas' ports; ``inhibit_ipv4`` leaves the bridge without one."""
    return {
        "name": network_name(run_id),
        "driver": "bridge",
        "internal": True,
        "options": {"com.docker.network.bridge.inhibit_ipv4": "true"},
        "labels": run_labels(run_id, run_dir),
    }


def container_config(launch: ReplicaLaunch) -> dict:
    """Keyword arguments of ``client.containers.run`` for one replica: no capabilities, no
    privilege to gain, a read-only root file system with a private /tmp, a bounded process count."""
    layout, replica, spec, home, run_dir, user, launched_at = launch
    view = replica_view(spec, run_dir, home)
    needs = replica_spec(spec, replica)
    # A container ends itself at its deadline, as a local replica's keeper ends it, whether or not
    # anything is left to stop it: SIGTERM, then SIGKILL after the grace (TF may ignore SIGTERM).
    # Before that, once its supervisor is gone: its lease, seen through the bind mount, or its
    # heartbeat where the engine does not share this kernel (hetflow.cluster.lease).
    deadline = ATTACH_TIMEOUT_SECONDS + spec.cluster.run_policy.timeout_seconds
    config = {
        "image": needs.image,
        "entrypoint": [
            "timeout",
            f"--kill-after={STOP_GRACE_SECONDS}",
            f"{deadline:.0f}",
            "python",
            "-m",
            "hetflow.replica",
        ],
        "command": ["--run-dir", str(run_dir), "--watch-supervisor", "lease", "--watch-supervisor", "heartbeat"],
        "name": replica.host,
        "hostname": replica.host,
        "user": user,
        # The supervisor's uid has no home directory in the image; libraries that cache under
        # $HOME (matplotlib, TFDS) need a writable one.
        "environment": {**replica_environment(layout, replica, home, launched_at), "HOME": "/tmp"},
        "labels": {**run_labels(layout.run_id, run_dir), LABEL_ROLE: replica.role, LABEL_INDEX: str(replica.index)},
        "network": network_name(layout.run_id),
        "volumes": {
            **{str(path): {"bind": str(path), "mode": "rw"} for path in view["read_write"]},
            **{str(path): {"bind": str(path), "mode": "ro"} for path in view["read_only"]},
        },
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "read_only": True,
        "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={TMP_BYTES}"},
        "pids_limit": PIDS_LIMIT,
        # The supervisor restarts replicas (restart_policy), as on every backend.
        "restart_policy": {"Name": "no"},
        "detach": True,
    }
    if needs.cpus:
        config["nano_cpus"] = round(needs.cpus * 1e9)
    if spec.cluster.pin_cores:
        config["cpuset_cpus"] = str(core_assignment(layout)[replica.name])
    if needs.memory_mb:
        config["mem_limit"] = f"{needs.memory_mb}m"
    if needs.gpus:
        config["device_requests"] = [{"Driver": "", "Count": needs.gpus, "Capabilities": [["gpu"]]}]
    return config


def replica_state(attrs: dict) -> ReplicaState:
    """A container's state, from its ``docker inspect`` attributes."""
    state = attrs["State"]
    finished = state["Status"] in ("exited", "dead")
    out_of_memory = (
        "ran out of memory: the kernel ended it at its replica_memory_mb limit" if state.get("OOMKilled") else None
    )
    return ReplicaState(exit_code=state["ExitCode"] if finished else None, note=out_of_memory)


class DockerReplicas(EngineReplicas):
    """The docker backend's side of the supervision (``supervisor.Replicas``): creates, inspects
    and stops the containers of one run."""

    def provision(self) -> None:
        """The run's network and every replica's container, started."""
        self.client.networks.create(**network_config(self.layout.run_id, self.run_dir))
        self.start(self.layout.replicas)

    def configure(self, replica: Replica, home: Path, user: str, launched_at: float) -> dict:
        return container_config(ReplicaLaunch(self.layout, replica, self.spec, home, self.run_dir, user, launched_at))

    def remove_named(self, name: str) -> None:
        self.client.containers.get(name).remove(force=True)

    def create(self, replica: Replica, config: dict) -> None:
        container = self.client.containers.run(**config)
        limits = [f"{config['nano_cpus'] / 1e9:g} CPUs"] if "nano_cpus" in config else []
        limits += [f"cpuset {config['cpuset_cpus']}"] if "cpuset_cpus" in config else []
        log.info(
            "started %s (container %s) at %s%s",
            replica.name,
            container.short_id,
            replica.address,
            f", {', '.join(limits)}" if limits else "",
        )

    def usage_sampler(self):  # the engine's counters of each container
        return ContainerUsage(self.client, run_filter(self.layout.run_id), (LABEL_ROLE, LABEL_INDEX))

    def poll(self) -> dict[str, ReplicaState]:
        found = {
            f"{c.labels[LABEL_ROLE]}-{c.labels[LABEL_INDEX]}": replica_state(c.attrs)
            for c in self.client.containers.list(all=True, filters=run_filter(self.layout.run_id))
        }
        # A container removed by someone else is gone with its exit code: count it as failed.
        return {r.name: found.get(r.name, ReplicaState(-1)) for r in self.layout.replicas}

    def stop(self, names) -> None:
        """Stop the containers all at once (SIGTERM, SIGKILL after the grace period)."""

        def stop_one(name: str) -> None:
            try:
                self.client.containers.get(container_name(self.layout.run_id, name)).stop(timeout=STOP_GRACE_SECONDS)
            except docker.errors.NotFound:
                pass

        with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
            list(pool.map(stop_one, names))

    def lines(self, name: str, since: float):
        """The container's output since it started (a restart is a new container), until it
        ends; kept in ``logs/<name>.log``."""
        try:
            container = self.client.containers.get(container_name(self.layout.run_id, name))
            stream = container.logs(stream=True, follow=True)
            log_path = self.logs_dir / f"{name}.log"
            yield from lines_to_file(cut_lines(stream), log_path)
        except docker.errors.NotFound:  # removed while streaming: its output is in the file
            return


def preflight(spec: RunSpec, run_id: str, client=None) -> list[str]:
    """What would stop the run's containers from starting, one line each, found before anything
    starts: no engine, no image, the run's names already taken, limits the host cannot give."""
    try:
        client = client or engine_client()
        info = client.info()
    except docker.errors.DockerException as error:
        reason = str(error).splitlines()[0][:200]
        return [f"backend=docker: no Docker engine answers ({reason}); start one (make engine) or use backend=local"]
    problems = []
    try:
        built_from = (client.images.get(spec.cluster.image).labels or {}).get(LABEL_SOURCE)
    except docker.errors.ImageNotFound:
        problems.append(
            f"image={spec.cluster.image} is not on the Docker engine: build it (make image) or pull it, "
            "or set image to one that is"
        )
    else:
        # Only images made by make image carry the label; a user's own image is theirs to keep current.
        if built_from is not None and built_from != source_digest():
            problems.append(
                f"image={spec.cluster.image} was built from other code than this checkout ({LABEL_SOURCE} "
                f"{built_from[:12]}, checkout {source_digest()[:12]}): rebuild it with make image"
            )
    taken = client.containers.list(all=True, filters=run_filter(run_id)) + client.networks.list(
        filters=run_filter(run_id)
    )
    if taken:
        problems.append(
            f"run {run_id} already has containers or a network on the Docker engine "
            f"({', '.join(sorted(item.name for item in taken))}): a run with this id is running or was not "
            "torn down; use another run id, or tear it down"
        )
    if spec.cluster.resources.cpus > info["NCPU"]:
        problems.append(
            f"replica_cpus={spec.cluster.resources.cpus:g} is invalid: the Docker host has {info['NCPU']} CPUs"
        )
    host_mb = info["MemTotal"] // 2**20
    if spec.cluster.resources.memory_mb > host_mb:
        problems.append(
            f"replica_memory_mb={spec.cluster.resources.memory_mb} is invalid: the Docker host has {host_mb} MiB"
        )
    if spec.cluster.resources.request_gpus and "nvidia" not in info.get("Runtimes", {}):
        problems.append(
            "request_gpus=true is invalid: the Docker engine has no nvidia runtime (install the NVIDIA Container "
            "Toolkit) or set request_gpus=false"
        )
    return problems


def teardown_run(run_id: str, client=None) -> list[str]:
    """Remove every container of the run and its network, found by label; nothing is left to save,
    so running containers are killed, all at once. Returns the names of the containers removed."""
    client = client or engine_client()
    selector = run_filter(run_id)
    containers = client.containers.list(all=True, filters=selector)

    def remove(container) -> None:
        try:
            container.remove(force=True)
        except docker.errors.NotFound:  # removed meanwhile (a concurrent teardown)
            pass

    with ThreadPoolExecutor(max_workers=max(1, len(containers))) as pool:
        list(pool.map(remove, containers))
    for network in client.networks.list(filters=selector):
        network.remove()
    return [c.name for c in containers]


def sweep_containers(home: Path, attach_seconds: float | None = None) -> dict[str, list[str]]:
    """Remove the containers and networks of this home's runs that no supervisor holds; returns
    their names. Needs a Docker engine; none answering, there is nothing to sweep. Swarm's task
    containers and overlay networks are the swarm backend's (``hetflow.cluster.backends.swarm.backend``)."""
    from hetflow.cluster.sweep import docker_time, interrupted_runs, run_is_live

    try:
        client = engine_client()
        client.ping()
    except docker.errors.DockerException:
        return {"containers": [], "networks": []}
    containers = [  # those made before runs were labelled with their directory are left alone
        c for c in client.containers.list(all=True, filters={"label": LABEL_RUN}) if LABEL_RUN_DIR in c.labels
    ]
    parts = [
        (
            c.labels[LABEL_RUN_ID],
            c.labels[LABEL_RUN_DIR],
            docker_time(c.attrs["State"].get("StartedAt") or c.attrs["Created"]),
        )
        for c in containers
    ]
    removed: dict[str, list[str]] = {"containers": [], "networks": []}
    for run_id in interrupted_runs(parts, home, attach_seconds):
        removed["containers"] += teardown_run(run_id, client)
        log.info("sweep: removed the containers and network of interrupted run %s", run_id)
    # A network whose containers are gone (its run was torn down halfway) goes too.
    for network in client.networks.list(filters={"label": LABEL_RUN}):
        network.reload()
        labels = network.attrs.get("Labels") or {}
        if network.attrs.get("Scope") != "local" or LABEL_RUN_DIR not in labels or network.attrs.get("Containers"):
            continue
        if not run_is_live(labels[LABEL_RUN_DIR], docker_time(network.attrs["Created"]), home, attach_seconds):
            network.remove()
            removed["networks"].append(network.name)
    return removed


class DockerBackend(Backend):
    """backend=docker as a ``Backend`` (``hetflow.cluster.backends.base``)."""

    replicas_type = DockerReplicas
    plan = staticmethod(plan)
    preflight = staticmethod(preflight)
    sweep = staticmethod(sweep_containers)

    def teardown(self, spec: RunSpec, run_id: str, grace: float | None = None) -> list[str]:
        return teardown_run(run_id)  # containers are killed at once: nothing is left to save


BACKEND = DockerBackend()

#!/usr/bin/env bash
# A Docker Swarm of several nodes on this machine, for trying backend=swarm (make swarm) and for
# the swarm tests: each node is a container running its own dockerd (docker/swarm-node.Dockerfile),
# the first one the manager, all on one bridge network, each with its own CPU quota and labels.
#
#   docker/swarm.sh up     start the nodes, join them, label them, load the replica image into each
#   docker/swarm.sh down   remove the nodes, their volumes and network: nothing is left on this engine
#
#   SWARM_NODES="node-1:1.0:cpu node-2:0.5:cpu"  name:CPUs:device of each node (CPUs as docker --cpus)
#   SWARM_SHARED=$HETFLOW_HOME  a path mounted at the same path on every node (the runs and the data)
#   SWARM_PREFIX=hetflow-swarm  names of the containers, network and sockets (one swarm per prefix)
#   IMAGE=hetflow-replica:0.1.0 the replica image loaded into every node
#
# `up` prints the DOCKER_HOST of the manager: its API is a unix socket under /run/<prefix>/, never
# a TCP port. A real deployment has the same shape: `docker swarm init` on one machine, `docker
# swarm join` on the others, `docker node update --label-add hetflow.device=...`, a shared path.
# Privileged containers are refused here: the nodes get the capabilities that suffice instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=${SWARM_PREFIX:-hetflow-swarm}
NODES=${SWARM_NODES:-"node-1:1.0:cpu node-2:0.5:cpu"}
SHARED=${SWARM_SHARED:-${HETFLOW_HOME:-$PWD/.hetflow}}
IMAGE=${IMAGE:-hetflow-replica:0.1.0}
NODE_IMAGE=hetflow-swarm-node:0.1.0
SOCKETS=/run/$PREFIX

node_docker() { docker -H "unix://$SOCKETS/$1/docker.sock" "${@:2}"; }

up() {
    docker image inspect "$IMAGE" >/dev/null 2>&1 || { echo "swarm.sh: no $IMAGE: run make image first" >&2; exit 1; }
    base=$(docker image inspect hetflow-base:bookworm >/dev/null 2>&1 && echo hetflow-base:bookworm || echo python:3.11-slim)
    docker build --quiet --build-arg "BASE_IMAGE=$base" -f docker/swarm-node.Dockerfile -t "$NODE_IMAGE" docker >/dev/null
    mkdir -p "$SHARED"
    docker network inspect "$PREFIX" >/dev/null 2>&1 || docker network create --label "hetflow.swarm=$PREFIX" "$PREFIX" >/dev/null
    names=()
    for node in $NODES; do
        IFS=: read -r name cpus device <<<"$node"
        names+=("$name")
        mkdir -p "$SOCKETS/$name"
        docker run --detach --name "$PREFIX-$name" --hostname "$name" --network "$PREFIX" \
            --label "hetflow.swarm=$PREFIX" --cpus "$cpus" \
            --cap-add SYS_ADMIN --cap-add NET_ADMIN --cap-add SYS_PTRACE --cap-add MKNOD --cap-add NET_RAW \
            --cap-add SYS_MODULE --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
            --device /dev/fuse -v /sys/fs/cgroup:/sys/fs/cgroup:rw --tmpfs /run \
            -v "$SOCKETS/$name:/run/hetflow-node" -v "$PREFIX-$name:/var/lib/docker" \
            -v "$SHARED:$SHARED" "$NODE_IMAGE" >/dev/null
    done
    for name in "${names[@]}"; do
        for _ in $(seq 60); do node_docker "$name" info >/dev/null 2>&1 && break; sleep 0.5; done
        node_docker "$name" info >/dev/null || { docker logs --tail 5 "$PREFIX-$name" >&2; exit 1; }
    done
    manager=${names[0]}
    address=$(docker inspect -f "{{(index .NetworkSettings.Networks \"$PREFIX\").IPAddress}}" "$PREFIX-$manager")
    node_docker "$manager" swarm init --advertise-addr "$address" >/dev/null
    token=$(node_docker "$manager" swarm join-token -q worker)
    for name in "${names[@]:1}"; do node_docker "$name" swarm join --token "$token" "$address:2377" >/dev/null; done
    for node in $NODES; do
        IFS=: read -r name cpus device <<<"$node"
        node_docker "$manager" node update --label-add "hetflow.device=$device" "$name" >/dev/null
    done
    # The replica image, saved once and loaded into every node at once (no registry is needed).
    mkdir -p build
    docker save "$IMAGE" -o build/swarm-image.tar
    for name in "${names[@]}"; do node_docker "$name" load --quiet -i build/swarm-image.tar >/dev/null & done
    wait
    rm -f build/swarm-image.tar
    echo "swarm.sh: ${#names[@]} nodes (${NODES}) joined; shared path $SHARED"
    echo "export DOCKER_HOST=unix://$SOCKETS/$manager/docker.sock"
}

down() {
    containers=$(docker ps --all --quiet --filter "label=hetflow.swarm=$PREFIX")
    [ -z "$containers" ] || docker rm --force --volumes $containers >/dev/null
    volumes=$(docker volume ls --quiet --filter "name=^$PREFIX-")
    [ -z "$volumes" ] || docker volume rm $volumes >/dev/null
    ! docker network inspect "$PREFIX" >/dev/null 2>&1 || docker network rm "$PREFIX" >/dev/null
    rm -rf "$SOCKETS"
    echo "swarm.sh: $PREFIX removed"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    *) echo "usage: docker/swarm.sh up|down" >&2; exit 2 ;;
esac

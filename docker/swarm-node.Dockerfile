# A Docker Swarm node in a container: Debian's docker.io (dockerd) on the offline base image, for
# `make swarm` (docker/swarm.sh) and the swarm tests, which run several such nodes on one machine.
# Each node runs its own engine; docker/swarm-node.sh starts it (see there for why each flag).
ARG BASE_IMAGE=hetflow-base:bookworm
FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends docker.io iptables ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY swarm-node.sh /usr/local/bin/swarm-node.sh
ENTRYPOINT ["/usr/local/bin/swarm-node.sh"]

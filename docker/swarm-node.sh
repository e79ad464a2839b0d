#!/bin/sh
# Entry point of a swarm node container (docker/swarm-node.Dockerfile): starts the node's dockerd.
#
# - Its API is a unix socket in /run/hetflow-node (a directory the host mounts), never TCP: the
#   host's hetflow talks to the manager through it, and nothing listens on the nodes' network
#   except Swarm's own ports.
# - Its containers' cgroups go under the node container's own (--cgroup-parent): the host's
#   cgroup tree is mounted here, and without it the replicas would escape the node's CPU quota.
# - overlay2 on /var/lib/docker, a volume of the node (an overlay file system cannot hold another).
set -eu
own_cgroup=$(awk -F: '$2 ~ /(^|,)cpu(,|$)/ {print $3}' /proc/self/cgroup)
exec dockerd --host unix:///run/hetflow-node/docker.sock --storage-driver overlay2 \
    --cgroup-parent "${own_cgroup%/}/replicas" "$@"

#!/usr/bin/env bash
# Prints the base image for hetflow's images: WANTED when it is here or can be pulled, else Debian
# bookworm with python3 built offline by debootstrap from the Debian mirror apt already uses,
# imported once as hetflow-base:bookworm (no image registry reachable, as on this project's machines).
#
#   docker/base-image.sh WANTED        e.g. python:3.11-slim; messages go to stderr
#
# Used by build-image.sh (the replica image) and stack-images.sh (the compose stack's images).
set -euo pipefail
cd "$(dirname "$0")/.."
WANTED=${1:?usage: docker/base-image.sh IMAGE}
OFFLINE_BASE=hetflow-base:bookworm
if docker image inspect "$WANTED" >/dev/null 2>&1 || docker pull -q "$WANTED" >/dev/null 2>&1; then
    echo "$WANTED"
    exit 0
fi
if ! docker image inspect "$OFFLINE_BASE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || {
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
    } >&2
    mirror=$(apt-get indextargets --format '$(REPO_URI)' 'Identifier: Packages' 2>/dev/null \
             | grep -m1 -v security || true)
    mirror=${mirror:-http://deb.debian.org/debian/}
    echo "base-image: $WANTED cannot be pulled; building $OFFLINE_BASE with debootstrap from $mirror" >&2
    mkdir -p build
    rootfs=$(mktemp -d)
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror" \
        >build/debootstrap.log 2>&1 || { tail -5 build/debootstrap.log >&2; exit 1; }
    tar -C "$rootfs" -c . | docker import - "$OFFLINE_BASE" >/dev/null
fi
echo "base-image: base $OFFLINE_BASE (no registry reachable for $WANTED)" >&2
echo "$OFFLINE_BASE"

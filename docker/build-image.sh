#!/usr/bin/env bash
# Builds the replica image (docker/Dockerfile) and prints its size and build time.
#
#   docker/build-image.sh [IMAGE]          IMAGE defaults to hetflow-replica:0.1.0
#   BASE_IMAGE=python:3.11-slim            the base, pulled when a registry is reachable
#
# Where BASE_IMAGE is neither present nor pullable (no registry reachable), the base is Debian
# bookworm with python3 built offline (docker/base-image.sh: hetflow-base:bookworm). The Python
# packages are the replica's pins, taken from the wheelhouse `make setup` fetched from
# requirements.lock (build/wheelhouse), so the build itself needs no network. A second build with
# nothing changed is served from Docker's cache.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${1:-hetflow-replica:0.1.0}
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
PIP=${PIP:-.venv/bin/pip}
CONTEXT=build/replica-image
started=$(date +%s%N)
mkdir -p build
[ -f build/wheelhouse/.complete ] || { echo "build-image: no build/wheelhouse: make setup fetches it" >&2; exit 1; }

BASE_IMAGE=$(docker/base-image.sh "$BASE_IMAGE")

# The context holds only what the Dockerfile copies, with the sources' modification times, so
# Docker's cache sees nothing changed when nothing did.
mkdir -p "$CONTEXT/wheelhouse"
"$PIP" wheel --quiet --no-index --find-links build/wheelhouse --wheel-dir "$CONTEXT/wheelhouse" \
    -c requirements.lock -r docker/replica-requirements.txt \
    2> >(grep -v "is ignored: it is neither" >&2)
cp -p requirements.lock docker/replica-requirements.txt "$CONTEXT/"
rm -rf "$CONTEXT/hetflow"
tar -c --exclude=__pycache__ hetflow | tar -x -C "$CONTEXT"

# Labelled with a digest of the code and pins, which a run's preflight compares with its checkout's.
digest=$(.venv/bin/python -c 'from hetflow.cluster.engine import source_digest; print(source_digest())')
docker build --quiet --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "SOURCE_DIGEST=$digest" --label "hetflow.source-digest=$digest" \
    -f docker/Dockerfile -t "$IMAGE" "$CONTEXT" >/dev/null
# Its dependencies' stage, which the compose stack's image builds on (docker/stack-images.sh): from
# the cache just filled, in seconds.
docker build --quiet --build-arg "BASE_IMAGE=$BASE_IMAGE" --target runtime \
    -f docker/Dockerfile -t "${IMAGE%%:*}-runtime:${IMAGE##*:}" "$CONTEXT" >/dev/null
seconds=$(( ($(date +%s%N) - started) / 1000000 ))e-3
bytes=$(docker image inspect "$IMAGE" --format '{{.Size}}')
printf 'build-image: %s built in %.1f s, %d MB (base %s)\n' "$IMAGE" "$seconds" $((bytes / 1000000)) "$BASE_IMAGE"
printf '{"image": "%s", "base": "%s", "seconds": %.1f, "bytes": %d, "at": "%s"}\n' \
    "$IMAGE" "$BASE_IMAGE" "$seconds" "$bytes" "$(date -u +%FT%TZ)" >>build/image-builds.jsonl

#!/usr/bin/env bash
# Builds the compose stack's images (docker/compose.yaml) and writes build/stack-images.env, which
# `make up-docker` passes to compose with the secrets' env file. Prints each image's build time.
#
#   PostgreSQL  POSTGRES_IMAGE, default the official postgres:17.6-bookworm, used where it is here
#               or can be pulled; where not (no registry reachable, as on this project's machines)
#               hetflow-postgres:15-bookworm is built: Debian bookworm's postgresql-15 on the
#               offline base (docker/postgres.Dockerfile). Set POSTGRES_IMAGE to that name to
#               build and use it anyway.
#   Airflow and hetflow-stack:0.1.0 (docker/stack.Dockerfile), on the replica image's dependency
#   MLflow      stage hetflow-replica-runtime:0.1.0 (docker/build-image.sh builds it: run that
#               first), plus the pins it lacks, taken from the wheelhouse `make setup` fetched
#               from requirements.lock (build/wheelhouse), so `docker build` needs no network.
#
# A second run with nothing changed is served from Docker's cache.
set -euo pipefail
cd "$(dirname "$0")/.."
OFFICIAL_POSTGRES=postgres:17.6-bookworm
OFFLINE_POSTGRES=hetflow-postgres:15-bookworm
POSTGRES_IMAGE=${POSTGRES_IMAGE:-$OFFICIAL_POSTGRES}
STACK_IMAGE=hetflow-stack:0.1.0
RUNTIME_IMAGE=hetflow-replica-runtime:0.1.0
PIP=${PIP:-.venv/bin/pip}
CONTEXT=build/stack-image
mkdir -p build

timed_build() {  # IMAGE, then docker build's arguments; prints the time and size
    local image=$1 started
    shift
    started=$(date +%s%N)
    docker build --quiet -t "$image" "$@" >/dev/null
    printf 'stack-images: %s built in %.1f s, %d MB\n' "$image" \
        "$(( ($(date +%s%N) - started) / 1000000 ))e-3" $(( $(docker image inspect "$image" --format '{{.Size}}') / 1000000 ))
}

if [ "$POSTGRES_IMAGE" = "$OFFICIAL_POSTGRES" ] && ! docker image inspect "$POSTGRES_IMAGE" >/dev/null 2>&1 \
        && ! docker pull -q "$POSTGRES_IMAGE" >/dev/null 2>&1; then
    echo "stack-images: $OFFICIAL_POSTGRES cannot be pulled; building $OFFLINE_POSTGRES"
    POSTGRES_IMAGE=$OFFLINE_POSTGRES
fi
if [ "$POSTGRES_IMAGE" = "$OFFLINE_POSTGRES" ]; then
    # apt inside the build reaches Debian's mirror through the base's own sources.list
    timed_build "$OFFLINE_POSTGRES" --build-arg "BASE_IMAGE=$(docker/base-image.sh hetflow-base:bookworm)" \
        -f docker/postgres.Dockerfile docker/postgres
fi

[ -f build/wheelhouse/.complete ] || { echo "stack-images: no build/wheelhouse: make setup fetches it" >&2; exit 1; }
docker image inspect "$RUNTIME_IMAGE" >/dev/null 2>&1 \
    || { echo "stack-images: no $RUNTIME_IMAGE: docker/build-image.sh (make image) builds it" >&2; exit 1; }
# The context holds only what stack.Dockerfile copies, with the sources' modification times, so
# Docker's cache sees nothing changed when nothing did. Its wheelhouse holds the pins the runtime's
# venv lacks (the lock pins every dependency, hence --no-deps).
mkdir -p "$CONTEXT"
docker run --rm --entrypoint pip "$RUNTIME_IMAGE" freeze --all >"$CONTEXT/runtime-freeze.txt"
.venv/bin/python - "$CONTEXT/runtime-freeze.txt" >"$CONTEXT/stack-only.txt" <<'PY'
import re, sys
def key(line):
    name, _, version = line.strip().partition("==")
    return re.sub(r"[-_.]+", "-", name).lower(), version
installed = {key(line) for line in open(sys.argv[1]) if "==" in line}
print("".join(line for line in open("requirements.lock") if "==" in line and key(line) not in installed), end="")
PY
mkdir -p "$CONTEXT/wheelhouse"
"$PIP" wheel --quiet --no-deps --no-index --find-links build/wheelhouse --wheel-dir "$CONTEXT/wheelhouse" \
    -r "$CONTEXT/stack-only.txt" \
    2> >(grep -v "is ignored: it is neither" >&2)
cp -p requirements.lock docker/replica-requirements.txt "$CONTEXT/"
rm -rf "$CONTEXT/hetflow" "$CONTEXT/dags" "$CONTEXT/plugins"
tar -c --exclude=__pycache__ hetflow dags plugins | tar -x -C "$CONTEXT"
timed_build "$STACK_IMAGE" --build-arg "RUNTIME_IMAGE=$RUNTIME_IMAGE" -f docker/stack.Dockerfile "$CONTEXT"

printf 'POSTGRES_IMAGE=%s\nSTACK_IMAGE=%s\n' "$POSTGRES_IMAGE" "$STACK_IMAGE" >build/stack-images.env

#!/usr/bin/env bash
# Makes sure a Docker engine answers on this machine: installs Debian's docker.io when dockerd is
# missing and starts dockerd in the background when the engine is down (root only). Prints why
# when it cannot; the container tests then skip, saying the same. A Docker client alone (one sits
# in /usr/local/bin on some machines) is not an engine: `docker info` is the test.
set -uo pipefail
engine_up() { docker info >/dev/null 2>&1; }
engine_up && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "engine.sh: no Docker engine answers and starting one needs root; container tests will skip" >&2
    exit 1
fi
if ! command -v dockerd >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null \
        || { echo "engine.sh: apt-get install docker.io failed; container tests will skip" >&2; exit 1; }
fi
if ! command -v docker >/dev/null; then
    echo "engine.sh: docker.io installed no docker client; container tests will skip" >&2
    exit 1
fi
log=/var/log/hetflow-dockerd.log
setsid dockerd >"$log" 2>&1 </dev/null &
for _ in $(seq 60); do
    engine_up && { echo "engine.sh: dockerd started (log $log)"; exit 0; }
    sleep 0.5
done
echo "engine.sh: dockerd did not answer within 30 s (no cgroups? see $log): container tests will skip" >&2
tail -3 "$log" >&2
exit 1

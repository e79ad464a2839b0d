#!/usr/bin/env bash
# Makes sure `docker compose` (Compose v2, a plugin of the docker CLI) works: `make up-docker` needs
# its `up --wait` (v1, Debian bookworm's docker-compose 1.29, has no --wait and no top-level `name`).
# Where it is missing, installs Debian trixie's docker-compose 2.26.1-4, a static Go binary (needs
# only libc6 >= 2.34), as the CLI plugin in /usr/local/lib/docker/cli-plugins. apt fetches it with a
# temporary source list of its own: this machine's apt sources are left as they are. Root only.
set -euo pipefail
VERSION=2.26.1-4
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
docker compose version >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "compose-cli.sh: no 'docker compose' (Compose v2) and installing it needs root" >&2
    exit 1
fi
mirror=$(apt-get indextargets --format '$(REPO_URI)' 'Identifier: Packages' 2>/dev/null \
         | grep -m1 -v security || true)
mirror=${mirror:-http://deb.debian.org/debian/}
work=$(mktemp -d)
chmod 755 "$work"  # apt downloads as its own user, _apt
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial"
echo "deb $mirror trixie main" >"$work/sources.list"
apt_temp=(-o "Dir::Etc::sourcelist=$work/sources.list" -o Dir::Etc::sourceparts=/nonexistent
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::archives=$work")
apt-get -qq "${apt_temp[@]}" update
(cd "$work" && apt-get -qq "${apt_temp[@]}" download "docker-compose=$VERSION" 2>/dev/null)
dpkg-deb -x "$work"/docker-compose_*.deb "$work/root"
install -D -m 0755 "$work/root/usr/libexec/docker/cli-plugins/docker-compose" "$PLUGIN_DIR/docker-compose"
echo "compose-cli.sh: $(docker compose version) installed in $PLUGIN_DIR"

#!/usr/bin/env bash
# Build every image of compose/docker-compose.yml, so that
#   docker compose -f compose/docker-compose.yml up -d
# starts the fleet without building. As root on a Debian machine it also installs what is
# missing: a Docker engine (Debian's docker.io, started in the background when no init system
# runs it) and Compose v2 (the `docker compose` plugin, from Debian trixie's docker-compose
# package, extracted only: nothing else is upgraded). Where the default base image cannot be
# pulled (no registry answers), it makes a local one from Debian's packages with debootstrap.
#
# Usage: bash scripts/fleet-images.sh [--no-install] [--check]
# Exit status: 0 ready; 3 no Docker engine can run here (not root, or dockerd cannot start); 1 other failures.
#   --no-install   never install or start anything; fail with the fix when something is missing
#   --check        only report whether an engine, Compose v2 and the images are ready
# Environment:
#   ENVHUB_IMAGE        tag of the env server image          (default envhub:local)
#   ENVHUB_PROXY_IMAGE  tag of the replica proxy image        (default envhub-proxy:local)
#   ENVHUB_BASE_IMAGE   base image; unset: python:3.11-slim when it can be pulled, else the local
#                       envhub-base:bookworm (made here once)
#   ENVHUB_BUILD_CA     CA bundle handed to pip inside the build (TLS-intercepting proxies);
#                       default: $PIP_CERT, else the host's /etc/ssl/certs/ca-certificates.crt
#   DEBIAN_MIRROR       Debian archive for debootstrap and Compose (default http://deb.debian.org/debian)
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE="${ENVHUB_IMAGE:-envhub:local}"
PROXY_IMAGE="${ENVHUB_PROXY_IMAGE:-envhub-proxy:local}"
DEFAULT_BASE="python:3.11-slim"
LOCAL_BASE="envhub-base:bookworm"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PLUGIN_DIR="/usr/libexec/docker/cli-plugins"
DOCKERD_LOG="/var/log/envhub-dockerd.log"
install=1 check=0
for arg in "$@"; do
  case "$arg" in
    --no-install) install=0 ;;
    --check) check=1; install=0 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
  esac
done

say() { echo "== $*"; }
die() { echo "error: $*" >&2; exit 1; }
no_engine() { echo "error: no Docker engine can run here: $*" >&2; exit 3; }
need_root() { [ "$(id -u)" = 0 ] || die "$1 needs root; run this script as root (or $2)"; }
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

engine_up() { docker info >/dev/null 2>&1; }

ensure_engine() {
  engine_up && return 0
  [ "$install" = 1 ] || no_engine "none answers 'docker info'; start one (or run without --no-install as root)"
  [ "$(id -u)" = 0 ] || no_engine "none answers 'docker info', and installing or starting one needs root"
  if ! command -v dockerd >/dev/null 2>&1; then
    command -v apt-get >/dev/null 2>&1 || no_engine "no dockerd and no apt-get to install Debian's docker.io"
    say "installing Debian's docker.io"
    apt_install docker.io
  fi
  if ! engine_up; then
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
      systemctl start docker || true
    fi
  fi
  if ! engine_up && ! pgrep -x dockerd >/dev/null; then
    say "starting dockerd in the background (log: $DOCKERD_LOG)"
    setsid nohup dockerd >"$DOCKERD_LOG" 2>&1 </dev/null &
  fi
  for _ in $(seq 60); do engine_up && return 0; sleep 1; done
  tail -5 "$DOCKERD_LOG" >&2 || true
  no_engine "dockerd did not answer within 60 s (see $DOCKERD_LOG)"
}

ensure_compose() {
  docker compose version >/dev/null 2>&1 && return 0
  [ "$install" = 1 ] || die "Compose v2 ('docker compose') is missing; install the docker-compose-plugin"
  need_root "installing Compose v2" "install the docker compose plugin"
  say "installing Compose v2 from Debian trixie's docker-compose package (extracted only)"
  local tmp; tmp="$(mktemp -d)"
  mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial"
  echo "deb $MIRROR trixie main" >"$tmp/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
              -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o "APT::Get::List-Cleanup=0"
              -o "APT::Sandbox::User=root")  # the private directories are root's
  apt-get "${opts[@]}" update -qq >/dev/null
  (cd "$tmp" && apt-get "${opts[@]}" download -qq docker-compose >/dev/null)
  dpkg -x "$tmp"/docker-compose_*.deb "$tmp/root"
  install -D -m 0755 "$tmp/root/usr/libexec/docker/cli-plugins/docker-compose" "$PLUGIN_DIR/docker-compose"
  rm -rf "$tmp"
  docker compose version >/dev/null 2>&1 || die "the docker compose plugin did not run from $PLUGIN_DIR"
}

# The base image: $ENVHUB_BASE_IMAGE, else the official one when present or pullable, else local.
choose_base() {
  if [ -n "${ENVHUB_BASE_IMAGE:-}" ]; then BASE="$ENVHUB_BASE_IMAGE"; return 0; fi
  if docker image inspect "$DEFAULT_BASE" >/dev/null 2>&1 || timeout 120 docker pull -q "$DEFAULT_BASE" >/dev/null 2>&1; then
    BASE="$DEFAULT_BASE"; return 0
  fi
  BASE="$LOCAL_BASE"
  docker image inspect "$LOCAL_BASE" >/dev/null 2>&1 && return 0
  [ "$check" = 0 ] || return 0
  need_root "making the local base image" "set ENVHUB_BASE_IMAGE to an image you have"
  say "$DEFAULT_BASE cannot be pulled; making $LOCAL_BASE with debootstrap (about a minute)"
  command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap
  local root; root="$(mktemp -d)"
  # two stages, so dpkg can skip its fsyncs while the tree is built (about a third faster on a busy
  # disk); the setting is removed before the tree becomes the image
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates --foreign \
    bookworm "$root" "$MIRROR" >/dev/null
  echo force-unsafe-io >"$root/etc/dpkg/dpkg.cfg.d/envhub-build-unsafe-io"
  chroot "$root" /debootstrap/debootstrap --second-stage >/dev/null
  rm -f "$root/etc/dpkg/dpkg.cfg.d/envhub-build-unsafe-io"
  chroot "$root" apt-get clean
  rm -rf --one-file-system "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
         "$root"/usr/share/info/* "$root"/var/cache/debconf/*-old "$root"/var/log/*.log
  # --one-file-system: nothing debootstrap may have left mounted (/proc, /dev) is packed or deleted
  tar --one-file-system -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' - "$LOCAL_BASE" >/dev/null
  rm -rf --one-file-system "$root"
}

# pip inside the build trusts only its own CA list; hand it the host's bundle (proxies that
# intercept TLS). The file stays out of git and out of the final image.
stage_ca() {
  local ca="${ENVHUB_BUILD_CA:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}"
  if [ -f "$ca" ]; then
    cmp -s "$ca" compose/build-ca.pem || cp "$ca" compose/build-ca.pem
  else
    rm -f compose/build-ca.pem
  fi
}

# The code server reaches the engine through the socket's group; compose reads DOCKER_GID from compose/.env.
record_docker_gid() {
  local sock="${DOCKER_SOCKET:-/var/run/docker.sock}" env=compose/.env gid
  [ -S "$sock" ] || return 0
  gid="$(stat -c %g "$sock")"
  if [ -f "$env" ] && grep -q '^DOCKER_GID=' "$env"; then
    grep -q "^DOCKER_GID=$gid\$" "$env" || sed -i "s/^DOCKER_GID=.*/DOCKER_GID=$gid/" "$env"
  else
    printf '# group of %s, written by scripts/fleet-images.sh\nDOCKER_GID=%s\n' "$sock" "$gid" >>"$env"
  fi
}

build() {  # build <tag> <dockerfile> <log>
  DOCKER_BUILDKIT=0 docker build -q --force-rm --build-arg "BASE_IMAGE=$BASE" -f "$2" -t "$1" . >"$3" 2>&1
}

build_all() {
  stage_ca
  say "building $IMAGE and $PROXY_IMAGE on $BASE"
  local logs; logs="$(mktemp -d)"
  build "$IMAGE" compose/Dockerfile "$logs/envhub.log" & local envhub=$!
  build "$PROXY_IMAGE" compose/proxy/Dockerfile "$logs/proxy.log" & local proxy=$!
  local failed=0
  wait "$envhub" || { echo "--- $IMAGE build failed:"; tail -40 "$logs/envhub.log"; failed=1; } >&2
  wait "$proxy" || { echo "--- $PROXY_IMAGE build failed:"; tail -40 "$logs/proxy.log"; failed=1; } >&2
  rm -rf "$logs"
  [ "$failed" = 0 ] || die "image build failed"
  docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "^($IMAGE|$PROXY_IMAGE) " || true
}

if [ "$check" = 1 ]; then
  engine_up || no_engine "none answers 'docker info'"
  docker compose version >/dev/null 2>&1 || die "Compose v2 ('docker compose') is missing"
  for tag in "$IMAGE" "$PROXY_IMAGE"; do
    docker image inspect "$tag" >/dev/null 2>&1 || die "image $tag is not built"
  done
  say "engine, Compose v2, $IMAGE and $PROXY_IMAGE are ready"
  exit 0
fi
ensure_engine
ensure_compose
record_docker_gid
choose_base
build_all
say "ready: docker compose -f compose/docker-compose.yml up -d"

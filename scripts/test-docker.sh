#!/usr/bin/env bash
# The docker stage of CI: a Docker engine, Compose v2 and the fleet's images (scripts/fleet-images.sh
# installs and builds what is missing), then every `docker`-marked test: the compose fleet in real
# containers, replicas behind the proxy, the code sandbox's container backend.
# Skipped, saying why, only where no Docker engine can run (no root to start one, dockerd fails).
# Usage: bash scripts/test-docker.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh envs,train,dev,trl,gym
rc=0
bash scripts/fleet-images.sh || rc=$?
if [ "$rc" = 3 ]; then
  echo "== docker stage skipped: no Docker engine can run on this machine (see the error above)"
  exit 0
fi
[ "$rc" = 0 ] || exit "$rc"
exec .venv/bin/python -m pytest -m docker tests/docker tests/compose tests/env_servers "$@"

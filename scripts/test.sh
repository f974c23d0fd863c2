#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine, then run the whole suite.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-deps.sh
bash scripts/setup.sh envs,train,dev,trl,gym,tinker
# A second interpreter with the newer `openenv` package (it cannot share a venv with openenv-core),
# used by the interop test that drives its client against an envhub server.
if [ ! -x .venv-openenv010/bin/python ]; then
  echo "== creating .venv-openenv010 for the openenv 0.10 interop test"
  python3 -m venv .venv-openenv010
  .venv-openenv010/bin/python -m pip install -q "openenv==0.10.*" || echo "note: openenv 0.10 unavailable; its interop test will skip"
fi
exec .venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# Create (or reuse) the project virtualenv and install envhub with the given extras.
# Usage: bash scripts/setup.sh [extras]   (default extras: envs,train,dev)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-envs,train,dev}"
venv="${ENVHUB_VENV:-.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "== creating $venv"
  "$python" -m venv "$venv"
fi
stamp="$venv/.envhub-installed-$extras"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  echo "== installing envhub[$extras] (torch pinned to the CPU build by constraints.txt)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -c constraints.txt torch==2.13.0
  "$venv/bin/python" -m pip install -q -c constraints.txt -e ".[$extras]"
  touch "$stamp"
fi

#!/usr/bin/env bash
# Static checks: ruff (lint and import order) over the whole repository, mypy --strict over envhub/.
# Both read their settings from pyproject.toml. Usage: bash scripts/lint.sh   (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${ENVHUB_VENV:-.venv}/bin"
echo "== ruff check"
"$bin/ruff" check .
echo "== mypy (strict) over envhub/"
"$bin/mypy"

#!/usr/bin/env bash
# Static checks: ruff (lint and import order) over the whole repository, mypy --strict over envhub/,
# env_servers/, adapters/ and trainer/. Both read their settings from pyproject.toml, which also lists
# mypy's relaxations with their reasons: packages without type information imported as Any,
# transformers' unannotated factories and torch's Tensor.backward callable, and openenv-core's untyped
# base class subclassable.
# Usage: bash scripts/lint.sh   (after scripts/setup.sh envs,train,dev,trl,gym: mypy reads the adapters' packages)
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${ENVHUB_VENV:-.venv}/bin"
echo "== ruff check"
"$bin/ruff" check .
echo "== mypy (strict) over envhub/ env_servers/ adapters/ trainer/"
"$bin/mypy"

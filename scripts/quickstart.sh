#!/usr/bin/env bash
# Set up, bring up the math env server, warm a tiny model up with SFT, train it with GRPO over
# WebSocket, and print validation reward before and after. Results: runs/quickstart/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh envs,train
exec .venv/bin/python -m trainer.quickstart "$@"

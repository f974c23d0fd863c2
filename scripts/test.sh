#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine, then run the whole suite.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-deps.sh
bash scripts/setup.sh envs,train,dev,trl,gym,tinker,ray
# A second interpreter with the newer `openenv` package (it cannot share a venv with openenv-core),
# used by the interop test that drives its client against an envhub server.
if [ ! -x .venv-openenv010/bin/python ]; then
  echo "== creating .venv-openenv010 for the openenv 0.10 interop test"
  python3 -m venv .venv-openenv010
  .venv-openenv010/bin/python -m pip install -q "openenv==0.10.*" || echo "note: openenv 0.10 unavailable; its interop test will skip"
fi
bash scripts/lint.sh
# A third one with vLLM (its CPU build here, the GPU build where CUDA is): vLLM pins its own transformers,
# so it lives apart from TRL. The tests marked `vllm` skip in .venv and run here, after the main suite.
ENVHUB_VENV=.venv-vllm bash scripts/setup.sh envs,train,dev,vllm,tinker
# Given test paths, the vLLM stage runs only when one of them names the vLLM tests.
options=() paths=()
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then paths+=("$arg"); else options+=("$arg"); fi
done
status=0
.venv/bin/python -m pytest "$@" || status=$?
vllm_paths=(tests/trainer/test_vllm_cpu.py tests/trainer/test_sampler_server_vllm.py tests/service/test_service_vllm.py)
if [ "${#paths[@]}" -gt 0 ]; then
  vllm_paths=()
  for p in "${paths[@]}"; do
    case "$p" in
      tests/trainer/test_vllm_cpu.py*|tests/trainer/test_sampler_server_vllm.py*|tests/service/test_service_vllm.py*) vllm_paths+=("$p");;
      tests|tests/) vllm_paths+=(tests/trainer/test_vllm_cpu.py tests/trainer/test_sampler_server_vllm.py tests/service/test_service_vllm.py);;
      tests/trainer|tests/trainer/) vllm_paths+=(tests/trainer/test_vllm_cpu.py tests/trainer/test_sampler_server_vllm.py);;
      tests/service|tests/service/) vllm_paths+=(tests/service/test_service_vllm.py);;
    esac
  done
fi
if [ "${#vllm_paths[@]}" -gt 0 ] && { [ "$status" = 0 ] || [ "$status" = 1 ]; }; then
  echo "== tests that need vLLM, in .venv-vllm"
  .venv-vllm/bin/python -m pytest "${options[@]}" -m vllm "${vllm_paths[@]}" || { rc=$?; [ "$status" != 0 ] || status=$rc; }
fi
exit "$status"

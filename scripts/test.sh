#!/usr/bin/env bash
# Set up the environments and run every test tier: ruff + the main pytest suite (every test, the slow ones included:
# a bare `pytest` excludes them, see pyproject.toml), then the vLLM CPU tier in its own environment
# (scripts/test_vllm.sh; ROLLPLEX_SKIP_VLLM=1 skips it). Every extra is installed, so a test that would skip for a
# missing optional package fails instead (ROLLPLEX_REQUIRE_EXTRAS).
set -euo pipefail
cd "$(dirname "$0")/.."
# no pip cache: the two environments need ~8 GB already, and a CI machine's disk once ran out during the install
export PIP_NO_CACHE_DIR=${PIP_NO_CACHE_DIR:-1}
# free disk, printed so that an install that runs out of space (seen once on a CI machine) shows how much there was
df -h . | tail -1 | awk '{print "disk before the install: " $4 " free of " $2}'
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export ROLLPLEX_REQUIRE_EXTRAS=1
.venv/bin/python -m ruff check .
.venv/bin/python -m pytest -q -m "slow or not slow" "$@"
if [ "${ROLLPLEX_SKIP_VLLM:-0}" != "1" ]; then
  echo "== vLLM CPU tier (scripts/test_vllm.sh) =="
  bash scripts/test_vllm.sh
fi

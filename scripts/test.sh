#!/usr/bin/env bash
# Set up the environment and run the default test suite (slow tests excluded; `-m slow` runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
.venv/bin/python -m ruff check .
exec .venv/bin/python -m pytest -q "$@"

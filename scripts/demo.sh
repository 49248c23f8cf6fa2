#!/usr/bin/env bash
# Set up the environment and run the main job: a short GRPO training of a locally built Qwen2.5-VL on the
# built-in synthetic video task. Extra arguments go to `rollplex-trl demo` (see `--help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec .venv/bin/rollplex-trl demo "$@"

#!/usr/bin/env bash
# The vLLM CPU test tier: builds .venv-vllm if needed (scripts/setup_vllm_env.sh) and runs the tests of tests/vllm_cpu
# that need vLLM (marked needs_vllm) in it.
# Each test module runs in its own pytest process: vLLM's in-process engine initialises torch.distributed and its
# CPU shared-memory state once per process, so two engines of different shapes cannot share one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm_env.sh
VENV=${ROLLPLEX_VLLM_VENV:-.venv-vllm}
export VLLM_ENABLE_V1_MULTIPROCESSING=0  # the engine lives in the test process (the weight sync needs its model)
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}  # GiB; the default takes nearly all RAM
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# every package this tier needs must import: a missing one fails the tier instead of skipping its tests
export ROLLPLEX_REQUIRE_EXTRAS=1 ROLLPLEX_REQUIRE_VLLM=1
export PYTHONPATH=".:tests${PYTHONPATH:+:$PYTHONPATH}"
# a killed run leaves vLLM's CPU shared-memory files behind and the next start fails with errno 17
clean_shm() { find /dev/shm -maxdepth 1 -name '*cpushm*' -user "$(id -u)" -delete 2>/dev/null || true; }
clean_shm
trap clean_shm EXIT
# one checkpoint for every process (built by the first one that needs it)
export ROLLPLEX_CACHE=${ROLLPLEX_CACHE:-$HOME/.cache/rollplex_trl}
status=0
# only the modules that need vLLM: the others in tests/vllm_cpu are plain torch and run in the main suite (they
# need torchvision or transformers >= 5.20, which this environment cannot have)
for module in $(grep -l "pytest.mark.needs_vllm" tests/vllm_cpu/test_*.py); do
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$module" "$@" || status=$?
  clean_shm
done
exit $status

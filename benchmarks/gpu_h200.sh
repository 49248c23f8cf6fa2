#!/usr/bin/env bash
# GPU check for one H200 (the device tool's machine): the shared prefix and the overlap with transformers generate
# and a CUDA side stream, on a Qwen2.5-VL-3B-sized model with random weights. Prints the same tables as on CPU.
#
# That machine has Python 3.12, torch 2.11 (CUDA), transformers 5.17, accelerate, peft, pandas and pyarrow, but no
# trl, datasets or PyAV, and cannot download. Fetch their wheels here first (into .whl/, kept out of git):
#   bash benchmarks/gpu_wheels.sh
# then run, through the device tool, with carry [".whl"]:
#   bash benchmarks/gpu_h200.sh
# Results (JSON) go to $OUT (the device tool's folder that comes back), else /tmp/rollplex-gpu.
# Rehearsed on CPU in a Python 3.12 environment with the machine's torch/transformers versions and the same wheels
# (ROLLPLEX_GPU_REHEARSAL=1 runs the tiny preset and a few steps); never run on a GPU yet (no GPU was lent).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rollplex-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false ROLLPLEX_CACHE="$OUT/cache"
"$PY" - <<'PY'
import torch, transformers, trl
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("transformers", transformers.__version__, "trl", trl.__version__)
PY
if [ "${ROLLPLEX_GPU_REHEARSAL:-0}" = 1 ]; then
  preset=tiny; shared_args=(--steps 2 --repeats 1); overlap_args=(--steps 2 --frames 4 --size 56)
else
  preset=3b; shared_args=(--steps 3 --repeats 3); overlap_args=(--steps 4)
fi
timeout 300 "$PY" benchmarks/bench_shared_prefix.py --preset "$preset" --quick "${shared_args[@]}" \
    --out "$OUT/shared_prefix_h200.json" 2>&1 | tail -n 12
timeout 300 "$PY" benchmarks/bench_overlap.py --preset "$preset" "${overlap_args[@]}" \
    --out "$OUT/overlap_h200.json" 2>&1 | tail -n 12
# The Megatron backend at t = 1 on the GPU (transformers rollout bound to the trained weights; megatron-core's own
# CUDA path, no CPU shims), the rollout model mapped onto the shards through the driver's VMM
# (rollplex_weight_mapping='on': live bytes per sync vs the plan's at 2 MiB granules). Never run on a GPU yet.
timeout 300 "$PY" benchmarks/bench_megatron.py --preset "$preset" --quick --max-tp 1 --weight-mapping on \
    --out "$OUT/megatron_h200.json" 2>&1 | tail -n 8 || echo "megatron check failed (see above)"
# Phase-aware memory on CUDA (pinned host buffers, side-stream copies, allocator peaks per phase): off / on / on +
# activation offload side by side. Never run on a GPU yet.
timeout 300 "$PY" benchmarks/bench_memory.py --preset "$preset" --quick --offload \
    --out "$OUT/memory_h200.json" 2>&1 | tail -n 24 || echo "memory check failed (see above)"

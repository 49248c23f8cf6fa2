#!/usr/bin/env bash
# GPU check for one H200 (the device tool's machine): first the exactness audit (two audited GRPO steps), then the
# shared prefix and the overlap with transformers generate and a CUDA side stream, the Megatron backend and the
# phase-aware memory, on a Qwen2.5-VL-3B-sized model with random weights. Prints the same tables as on CPU.
#
# That machine has Python 3.12, torch 2.11 (CUDA), transformers 5.17, accelerate, peft, pandas and pyarrow, but no
# trl, datasets or PyAV, and cannot download. Fetch their wheels here first (into .whl/, kept out of git):
#   bash benchmarks/gpu_wheels.sh
# then run, through the device tool, with carry [".whl"]:
#   bash benchmarks/gpu_h200.sh
# Results (JSON) and the whole log (gpu_h200.log) go to $OUT (the device tool's folder that comes back), else
# /tmp/rollplex-gpu. The model checkpoint is built in /tmp/rollplex-cache (7 GB: it must not land in $OUT).
# The device lends 15 minutes per task, start included: the checks below are capped at ~9 minutes together.
# Rehearsal on CPU: `ROLLPLEX_GPU_REHEARSAL=1 PYTHON=.venv/bin/python bash benchmarks/gpu_h200.sh` from a checkout
# without .whl/ runs the tiny preset and a few steps (last rehearsed 2026-12-05, 1 min 21 s, all five checks).
# Never run on a GPU yet: no machine was lent when one was asked for.
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
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false ROLLPLEX_CACHE=${ROLLPLEX_CACHE:-/tmp/rollplex-cache}
exec > >(tee -a "$OUT/gpu_h200.log") 2>&1
"$PY" - <<'PY'
import torch, transformers, trl
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("transformers", transformers.__version__, "trl", trl.__version__)
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
if [ "${ROLLPLEX_GPU_REHEARSAL:-0}" = 1 ]; then
  preset=tiny; shared_args=(--steps 2 --repeats 1); overlap_args=(--steps 2 --frames 4 --size 56)
  memory_args=(--steps 3 --repeats 1)
else
  preset=3b; shared_args=(--steps 3 --repeats 2); overlap_args=(--steps 4); memory_args=(--steps 3 --repeats 1)
fi
# Seconds per check; together they stay inside one device call (timeout_s 570).
t_build=${T_BUILD:-100} t_audit=${T_AUDIT:-60} t_shared=${T_SHARED:-95} t_overlap=${T_OVERLAP:-85}
t_megatron=${T_MEGATRON:-100} t_memory=${T_MEMORY:-100}
stamp() { echo "[$(date +%T)] $*"; }
stamp "building the $preset checkpoint"
# Random initialisation of ~3.5 B parameters takes minutes on the CPU and seconds on the GPU: build it there.
timeout -k 5 "$t_build" "$PY" -c "
import sys, torch; sys.path.insert(0, 'benchmarks')
if torch.cuda.is_available():
    torch.set_default_device('cuda')
from bench_common import quiet_checkpoint
print(quiet_checkpoint('$preset'))" || { echo "checkpoint build failed or timed out"; exit 1; }
# Exactness first: two audited GRPO steps under TRL's defaults (every mechanism at its default) say whether the
# speed-ups changed any log-prob or the actor's gradient on this hardware (trainers/verify.py).
stamp "exactness audit"
timeout -k 5 "$t_audit" "$PY" benchmarks/gpu_audit.py --preset "$preset" --out "$OUT/audit_h200.json" 2>&1 \
    | tee -a "$OUT/bench_full.log" | tail -n 4 || echo "audit failed (see the log)"
stamp "shared prefix"
timeout -k 5 "$t_shared" "$PY" benchmarks/bench_shared_prefix.py --preset "$preset" --quick "${shared_args[@]}" \
    --out "$OUT/shared_prefix_h200.json" 2>&1 | tee -a "$OUT/bench_full.log" | tail -n 12 || echo "shared-prefix check failed (see the log)"
stamp "overlap"
timeout -k 5 "$t_overlap" "$PY" benchmarks/bench_overlap.py --preset "$preset" "${overlap_args[@]}" \
    --out "$OUT/overlap_h200.json" 2>&1 | tee -a "$OUT/bench_full.log" | tail -n 12 || echo "overlap check failed (see the log)"
# The Megatron backend at t = 1 on the GPU (transformers rollout bound to the trained weights; megatron-core's own
# CUDA path, no CPU shims), the rollout model mapped onto the shards through the driver's VMM
# (rollplex_weight_mapping='on': live bytes per sync vs the plan's at 2 MiB granules).
stamp "megatron"
timeout -k 5 "$t_megatron" "$PY" benchmarks/bench_megatron.py --preset "$preset" --quick --max-tp 1 \
    --weight-mapping on --out "$OUT/megatron_h200.json" 2>&1 | tee -a "$OUT/bench_full.log" | tail -n 8 || echo "megatron check failed (see the log)"
# Phase-aware memory on CUDA (pinned host buffers, side-stream copies, allocator peaks per phase): off / on / on +
# activation offload side by side.
stamp "memory"
timeout -k 5 "$t_memory" "$PY" benchmarks/bench_memory.py --preset "$preset" --offload "${memory_args[@]}" \
    --out "$OUT/memory_h200.json" 2>&1 | tee -a "$OUT/bench_full.log" | tail -n 24 || echo "memory check failed (see the log)"
stamp "done"

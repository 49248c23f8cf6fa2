#!/usr/bin/env bash
# GPU check for one H200 (the device tool's machine): the shared prefix and the overlap with transformers generate
# and a CUDA side stream, on a Qwen2.5-VL-3B-sized model with random weights. Prints the same tables as on CPU.
#
# That machine has torch (CUDA), transformers, accelerate and peft but no trl, datasets or PyAV. Bring their wheels
# (download them here first, then pass the folder with the device tool's `carry`):
#   .venv/bin/pip download --no-deps -d wheels trl==1.16.0 datasets av
# Not run yet: no GPU was lent to the task that wrote it (see the README's "What works today").
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rollplex-gpu}
mkdir -p "$OUT"
python -m pip install --no-deps --quiet wheels/*.whl 2>/dev/null || echo "warning: some wheels did not install"
python -m pip install --no-deps --quiet -e .
python - <<'PY'
import torch, transformers
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
print("transformers", transformers.__version__)
PY
export ROLLPLEX_CACHE="$OUT/cache"
timeout 240 python benchmarks/bench_shared_prefix.py --preset 3b --quick --steps 3 --repeats 3 \
    --out "$OUT/shared_prefix_h200.json" | tail -n 8
timeout 240 python benchmarks/bench_overlap.py --preset 3b --steps 4 --out "$OUT/overlap_h200.json" | tail -n 12

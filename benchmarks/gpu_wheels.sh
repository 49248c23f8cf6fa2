#!/usr/bin/env bash
# Download, here, the wheels the GPU check (benchmarks/gpu_h200.sh) needs on the device machine, into .whl/.
#
# That machine runs Python 3.12 with torch 2.11 (CUDA), transformers 5.17, accelerate, peft, pandas, pyarrow, xxhash,
# matplotlib and pillow already installed, and nothing can be fetched there. Missing: trl, datasets (and its dill and
# multiprocess), PyAV and megatron-core. Versions are the project's pins (constraints.txt). The wheels are small enough to travel
# with the working tree (the device tool's `carry` takes 64 MiB in all); .whl/ is kept out of git.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pin() { grep -E "^$1==" constraints.txt | head -1; }
dill=$(.venv/bin/python -c "import dill; print(dill.__version__)" 2>/dev/null || echo 0.4.0)
multiprocess=$(.venv/bin/python -c "import multiprocess; print(multiprocess.__version__)" 2>/dev/null || echo 0.70.18)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  "$(pin trl)" "$(pin datasets)" "$(pin av)" "$(pin megatron-core)" "dill==$dill" "multiprocess==$multiprocess"
ls -la .whl
du -sh .whl

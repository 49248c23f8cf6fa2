"""TP = 2 on vLLM's CPU backend under torchrun: each rank's shard is synced exactly (tp2_worker.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs_vllm


def test_tensor_parallel_sync_is_exact_on_every_rank(small_qwen2_path, tmp_path):
    worker = Path(__file__).with_name("tp2_worker.py")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29561",
           str(worker), str(small_qwen2_path), str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert done.returncode == 0 and len(results) == 2, done.stdout[-3000:] + done.stderr[-6000:]
    params = 17_411_072  # the small Qwen2; each rank receives its half of the sharded matrices, whole norms
    for r in sorted(results, key=lambda r: r["rank"]):
        assert r["before_step"] < 1e-4 and r["stale"] > 1e-2 and r["after"] < 1e-4, r
        assert r["aliased"] == []  # a rank holds slices: never aliased
        assert 0.5 * 4 * params < r["bytes"] < 0.75 * 4 * params, r

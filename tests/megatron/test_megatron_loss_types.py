"""Every TRL loss type on the Megatron backend (t = 1) trains what the `hf` backend trains: the same two steps
(gradient accumulation 2, two optimizer steps per generation, beta > 0, the shared prefix on in both), loss, KL,
grad norm, reward and entropy within 1e-4 relative. The loss types differ in their per-token terms (clipping,
CISPO's and SAPO's weights) and their normalisers (per sequence, per batch, constant, over the processes' tokens),
which the backend's per-token log-probs feed unchanged; a wrong mask, row order or normaliser moves the loss.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import require

require("megatron.core")

WORKER = Path(__file__).with_name("loss_types_worker.py")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")


def test_every_loss_type_learns_what_hf_learns(tiny_qwen2_path, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, str(WORKER), str(tiny_qwen2_path), str(tmp_path), *LOSS_TYPES], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-8000:]
    results = json.loads((tmp_path / "loss_types.json").read_text())
    losses = {}
    for loss_type in LOSS_TYPES:
        hf, megatron = results[loss_type]["hf"], results[loss_type]["megatron"]
        assert len(hf) == len(megatron) == 2, loss_type
        assert any(abs(r["loss"]) > 0 for r in hf) and all(r["grad_norm"] > 0 for r in hf), loss_type
        for step, (a, b) in enumerate(zip(megatron, hf, strict=True)):
            for key, value in b.items():
                if value is None:  # reward is logged at generation steps only
                    assert a[key] is None, (loss_type, step, key)
                    continue
                assert a[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (loss_type, step, key, a[key], value)
        assert hf[0]["completions/min_length"] < hf[0]["completions/max_length"], loss_type  # lengths differ
        losses[loss_type] = (hf[0]["grad_norm"], hf[1]["loss"])
    # the loss types really computed different things: the step-1 loss is ~0 for most (on-policy, zero-mean
    # advantages), so their normalisers show in the step-1 gradient and their clipping in the step-2 loss
    print(losses)
    assert len({round(g, 5) for g, _ in losses.values()}) >= 5 and len({round(v, 6) for _, v in losses.values()}) >= 5

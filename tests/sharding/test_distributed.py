"""Megatron-Core (gloo, one process per rank) -> shared-memory arenas -> vLLM-layout views, for real.

One job of 8 processes runs every (t, r) below on the same 8 "devices" (so t < 8 means training data parallelism
and r < 8 rollout data parallelism), each with two training conventions:
- ``bridge``: Megatron-Bridge (HF vision tower replicated, no vocabulary padding), peer bytes mapped (``map``);
- ``native``: Megatron-native vision tower sharded, Megatron-LM vocabulary padding, peer bytes copied (``copy``).
See ``dist_worker.py`` for what each check does.
"""

import json
import socket
import uuid
from pathlib import Path

import dist_worker
import pytest
import torch.multiprocessing as mp

from helpers import require

WORLD = 8
CONFIGS = [(8, 4), (4, 2), (2, 1), (2, 2)]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    require("megatron.core")
    out = tmp_path_factory.mktemp("sharding-dist")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cases = [(t, r, v) for t, r in CONFIGS for v in dist_worker.VARIANTS]
    session = uuid.uuid4().hex[:6]
    try:
        mp.spawn(dist_worker.main, args=(WORLD, port, cases, str(out), session), nprocs=WORLD)
    finally:
        for leftover in Path("/dev/shm").glob(f"rollplex-{session}*"):  # only after a crash
            leftover.unlink(missing_ok=True)
        found = [x for p in sorted(out.glob("rank*.json")) for x in json.loads(p.read_text())]
    return found


def _checks(records, t, r, prefix=""):
    mine = [x for x in records if x.get("t") == t and x.get("r") == r and x["check"].startswith(prefix)]
    assert mine, f"no records for t={t} r={r} {prefix!r}"
    bad = [f"{x['variant']} rank {x['rank']}: {x['check']}: {x['detail']}" for x in mine if not x["ok"]]
    assert not bad, "\n".join(bad[:10])
    return mine


@pytest.mark.parametrize("t,r", CONFIGS)
def test_megatron_shards_agree_with_megatron_forward(records, t, r):
    checks = _checks(records, t, r, "megatron")
    assert any("qkv split" in x["check"] for x in checks)


@pytest.mark.parametrize("t,r", CONFIGS)
def test_rollout_tensors_equal_vllm_loader_slicing(records, t, r):
    _checks(records, t, r, "rollout names")
    _checks(records, t, r, "every rollout tensor")
    _checks(records, t, r, "view_linear")


@pytest.mark.parametrize("t,r", CONFIGS)
def test_shared_tensors_share_training_storage(records, t, r):
    _checks(records, t, r, "direct views")
    _checks(records, t, r, "stitched pages")
    _checks(records, t, r, "some tensors are shared")


@pytest.mark.parametrize("t,r", CONFIGS)
def test_rebuilt_tensors_refresh_after_optimizer_steps(records, t, r):
    checks = _checks(records, t, r, "step ")
    assert {x["check"].split(":")[0] for x in checks} == {"step 1", "step 2"}

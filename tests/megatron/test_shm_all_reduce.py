"""The shared-memory TP all-reduce (backends/megatron/shm_all_reduce.py) against gloo, and the pooled rollout's
hand-over (backends/megatron/pooled_rollout.py), in 2 processes.

- the sum itself: equal to gloo's all_reduce bit for bit (two ranks: a + b = b + a), fp32/bf16/fp64, tensors
  smaller and many times larger than a slot (chunked), the same result on both ranks; a peer that never arrives
  is a named error after the timeout, not a hang; nothing is left in /dev/shm;
- routed into megatron-core (megatron_compat.route_tensor_parallel_all_reduce): MegatronPolicy at t = 2 gives
  bit-identical log-probs and gradients with the routing on and off (gloo), the routed all-reduce runs in the
  forward and in the backward, and then no TP-group all-reduce of the layers goes to gloo;
- the pooled rollout: the first rank decodes with both ranks' threads and runs the window's jobs with its own, the
  peer leaves its wait only once the first rank posted (after decoding, before the jobs), a first rank that never
  posts is a named error on the peer after the timeout.
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import require

require("megatron.core")
pytestmark = pytest.mark.filterwarnings("ignore")

SLOT = 1 << 14  # 16 KiB slots: the larger tensors below take dozens of chunks


def _leftovers() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(("rollplex-tp-allreduce-", "rollplex-rollout-")))


def _sum_checks(rank: int, record) -> None:
    from rollplex_trl.backends.megatron.shm_all_reduce import SharedMemoryAllReduce

    all_reduce = SharedMemoryAllReduce(None, slot_bytes=SLOT, timeout_s=600.0)
    # rank 0 unlinks right after the mapping barrier: without this barrier rank 1 could look before it has (a race
    # that failed once on a loaded machine)
    dist.barrier()
    record("file unlinked once mapped", not _leftovers(), str(_leftovers()))
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    for shape, dtype in [((3,), torch.float32), ((412, 512), torch.float32), ((50_001,), torch.bfloat16),
                         ((7, 9), torch.float64), ((SLOT // 4,), torch.float32)]:
        x = torch.randn(*shape, generator=gen).to(dtype)
        want = x.clone()
        dist.all_reduce(want)
        got = all_reduce(x.clone())
        record(f"equals gloo {tuple(shape)} {dtype}", torch.equal(got, want),
               f"max diff {(got.double() - want.double()).abs().max().item()}")
        both = [torch.empty_like(got) for _ in range(2)]
        dist.all_gather(both, got)
        record(f"same on both ranks {tuple(shape)} {dtype}", torch.equal(both[0], both[1]))
    record("counts calls and bytes", all_reduce.calls == 5, f"{all_reduce.calls} calls, {all_reduce.bytes} bytes")
    all_reduce.close()

    # a peer that stops calling: rank 0 calls once more, rank 1 does not
    late = SharedMemoryAllReduce(None, slot_bytes=SLOT, timeout_s=1.0)
    if rank == 0:
        try:
            late(torch.ones(4))
            record("a missing peer is an error", False, "returned")
        except RuntimeError as err:
            record("a missing peer is an error", "TP ranks [1] did not arrive" in str(err), str(err))
    dist.barrier()
    late.close()


def _routing_checks(path: str, rank: int, record) -> None:
    import megatron_worker as mw

    from rollplex_trl import megatron_compat
    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel
    from rollplex_trl.backends.megatron.shm_all_reduce import SharedMemoryAllReduce

    groups = init_model_parallel(2)
    policy = MegatronPolicy(mw.load_hf(path), groups)
    batch = mw.video_batch(path)

    def run():
        policy.zero_grad(set_to_none=True)
        logps, entropy = mw.policy_logps(policy, batch)
        mw.loss_of(logps, entropy, batch).backward()
        return logps.detach(), {n: p.grad.clone() for n, p in policy.gpt.named_parameters() if p.grad is not None}

    gloo_logps, gloo_grads = run()
    all_reduce = SharedMemoryAllReduce(groups.tp_group, slot_bytes=SLOT)
    undo = megatron_compat.route_tensor_parallel_all_reduce(groups.tp_group, all_reduce)
    gloo_calls = []
    original = dist.all_reduce

    def counting(tensor, *args, group=None, **kwargs):
        if group is groups.tp_group and tensor.numel() > 64:  # the layers' sums (the log-prob reductions are tiny)
            gloo_calls.append(tuple(tensor.shape))
        return original(tensor, *args, group=group, **kwargs)

    dist.all_reduce = counting
    try:
        policy.zero_grad(set_to_none=True)
        logps, entropy = mw.policy_logps(policy, batch)
        forward_calls = all_reduce.calls
        mw.loss_of(logps, entropy, batch).backward()
        backward_calls = all_reduce.calls - forward_calls
        shm_grads = {n: p.grad.clone() for n, p in policy.gpt.named_parameters() if p.grad is not None}
    finally:
        dist.all_reduce = original
    layers = policy.gpt.config.num_layers
    # forward: the embedding + 2 per layer (attention out, MLP down); backward: 2 per layer (q/k/v and gate/up input
    # gradients) + the output layer's input gradient
    record("routed in the forward", forward_calls >= 1 + 2 * layers, f"{forward_calls} calls, {layers} layers")
    record("routed in the backward", backward_calls >= 2 * layers, f"{backward_calls} calls")
    record("no layer all-reduce left on gloo", not gloo_calls, str(gloo_calls[:4]))
    record("log-probs bit-identical to gloo", torch.equal(logps.detach(), gloo_logps),
           f"max diff {(logps.detach() - gloo_logps).abs().max().item()}")
    record("gradients bit-identical to gloo", shm_grads.keys() == gloo_grads.keys() and all(
        torch.equal(shm_grads[n], gloo_grads[n]) for n in gloo_grads), f"{len(gloo_grads)} tensors")
    undo()
    again_logps, again_grads = run()
    record("undo restores gloo", all_reduce.calls == forward_calls + backward_calls
           and torch.equal(again_logps, gloo_logps))
    all_reduce.close()


def _pool_checks(rank: int, record, out_dir: str) -> None:
    import contextlib
    import time

    from rollplex_trl.backends.megatron.pooled_rollout import PooledRollout

    pool = PooledRollout(None, rank, 2)
    own = torch.get_num_threads()
    seen = {}

    @contextlib.contextmanager
    def window(input_ids, attention_mask):  # the overlap window: the jobs run at its exit (serial schedule)
        yield
        seen["jobs"] = torch.get_num_threads()
        dist.barrier()  # the jobs' TP collectives

    if pool.decodes:
        with pool.decoding():
            with pool.window(window)(None, None):
                seen["decode"] = torch.get_num_threads()
                time.sleep(0.5)  # decoding
                Path(out_dir, "decoded").write_text("done")  # before the post: the peer must see it
        record("pool: decode with both ranks' threads", seen["decode"] == pool.pooled_threads == min(
            2 * own, len(os.sched_getaffinity(0))), f"{seen['decode']} threads, own {own}")
        record("pool: jobs with the rank's own threads", seen["jobs"] == own, str(seen["jobs"]))
        record("pool: own threads restored", torch.get_num_threads() == own)

    else:
        with window(None, None):
            pool.wait()
            seen["decoded"] = Path(out_dir, "decoded").exists()
        record("pool: the peer waits for the decode", seen["decoded"], "left its wait before the decode ended")

    record("pool: peer and first rank ran the window's jobs", "jobs" in seen)
    pool.close()

    late = PooledRollout(None, rank, 2, timeout_s=1.0)  # a first rank that never posts
    if not late.decodes:
        try:
            late.wait()
            record("pool: a silent first rank is an error", False, "returned")
        except RuntimeError as err:
            record("pool: a silent first rank is an error", "did not finish decoding" in str(err), str(err))
    dist.barrier()
    late.close()


def _main(rank: int, world: int, port: int, path: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    records: list[dict] = []

    def record(check, ok=True, detail=""):
        records.append({"rank": rank, "check": check, "ok": bool(ok), "detail": detail})

    try:
        _sum_checks(rank, record)
        _pool_checks(rank, record, out_dir)
        _routing_checks(path, rank, record)
    except Exception:
        record("no exception", False, traceback.format_exc())
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
        from rollplex_trl.backends.megatron import release_model_parallel

        release_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def records(tiny_vl_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("shm-all-reduce")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_main, args=(2, port, str(tiny_vl_path), str(out)), nprocs=2)
    finally:
        found = [r for p in sorted(out.glob("rank*.json")) for r in json.loads(p.read_text())]
    return found


CHECKS = ["file unlinked once mapped", "equals gloo (3,) torch.float32", "equals gloo (412, 512) torch.float32",
          "equals gloo (50001,) torch.bfloat16", "equals gloo (7, 9) torch.float64",
          "equals gloo (4096,) torch.float32",
          "same on both ranks (412, 512) torch.float32", "same on both ranks (50001,) torch.bfloat16",
          "counts calls and bytes", "routed in the forward", "routed in the backward",
          "no layer all-reduce left on gloo", "log-probs bit-identical to gloo", "gradients bit-identical to gloo",
          "undo restores gloo"]


@pytest.mark.parametrize("check", CHECKS)
def test_two_ranks(records, check):
    failed = [r for r in records if r["check"] == "no exception"]
    assert not failed, failed[0]["detail"]
    mine = [r for r in records if r["check"] == check]
    assert {r["rank"] for r in mine} == {0, 1}, f"no record of {check!r} on both ranks"
    bad = [f"rank {r['rank']}: {r['detail']}" for r in mine if not r["ok"]]
    assert not bad, "; ".join(bad)


def test_a_missing_peer_is_a_named_error(records):
    mine = [r for r in records if r["check"] == "a missing peer is an error"]
    assert len(mine) == 1 and mine[0]["ok"], mine


@pytest.mark.parametrize("check", ["pool: decode with both ranks' threads", "pool: jobs with the rank's own threads",
                                   "pool: own threads restored", "pool: the peer waits for the decode",
                                   "pool: a silent first rank is an error"])
def test_pooled_rollout_hand_over(records, check):
    failed = [r for r in records if r["check"] == "no exception"]
    assert not failed, failed[0]["detail"]
    mine = [r for r in records if r["check"] == check]
    assert len(mine) == 1 and mine[0]["ok"], mine
    both = [r for r in records if r["check"] == "pool: peer and first rank ran the window's jobs"]
    assert {r["rank"] for r in both if r["ok"]} == {0, 1}


def test_nothing_left_in_dev_shm(records):
    assert not _leftovers()


# ---- the machine's memory model (no processes: the decision before any collective) --------------------------------

def _routing(mode: str):
    """MegatronBackend._route_all_reduce at t = 2 on CPU, on a stand-in backend (only its groups are read)."""
    from types import SimpleNamespace

    from rollplex_trl.backends.megatron.backend import MegatronBackend

    backend = SimpleNamespace(groups=SimpleNamespace(tp_size=2, tp_group=None))
    return MegatronBackend._route_all_reduce(backend, mode, torch.device("cpu"))


@pytest.mark.parametrize("machine", ["x86_64", "AMD64", "i686"])
def test_x86_keeps_the_shared_memory_all_reduce(monkeypatch, machine):
    from rollplex_trl.backends.megatron import mapped_weights, shm_all_reduce

    monkeypatch.setattr(shm_all_reduce.platform, "machine", lambda: machine)
    assert shm_all_reduce.store_order_reason() is None
    # a 1-rank stand-in for the group's agreement (the decision is local)
    monkeypatch.setattr(mapped_weights, "agree", lambda reason, group, size: reason)
    assert shm_all_reduce.shm_all_reduce_reason(torch.device("cpu"), None, 2) is None


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", "riscv64", ""])
def test_not_x86_auto_takes_gloo_and_on_is_refused(monkeypatch, machine):
    """The protocol's plain stores rely on x86's store order: elsewhere 'auto' takes gloo with the reason, 'on' is
    a ValueError naming the field, the reason and what to use, before any collective (none is set up here)."""
    from rollplex_trl.backends.megatron import mapped_weights, shm_all_reduce

    monkeypatch.setattr(shm_all_reduce.platform, "machine", lambda: machine)
    monkeypatch.setattr(mapped_weights, "agree", lambda reason, group, size: reason)
    reason = shm_all_reduce.shm_all_reduce_reason(torch.device("cpu"), None, 2)
    assert reason is not None and "not x86" in reason and (machine or "unknown") in reason
    all_reduce, note = _routing("auto")
    assert all_reduce is None and note == f"gloo ({reason})"
    assert _routing("off") == (None, "gloo (rollplex_shm_all_reduce='off')")
    for refuse in (lambda: _routing("on"), lambda: shm_all_reduce.SharedMemoryAllReduce(None)):
        with pytest.raises(ValueError, match=r"rollplex_shm_all_reduce='on' cannot run here: .*not x86.*"
                                             r"use rollplex_shm_all_reduce='auto' or 'off'"):
            refuse()

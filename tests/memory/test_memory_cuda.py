"""CUDA-only checks: address-stable offload (driver VMM API), the streamed optimizer's side stream, saved-tensor
offload to pinned memory, allocator statistics in the ledger. Skipped without a GPU (none was available when they
were written: they have NOT been run)."""

import pytest
import torch
from torch import nn

from rollplex_trl.memory import MemoryLedger, MemoryRegistry, ResidencyManager, SavedTensorOffload, StreamedOptimizer
from rollplex_trl.memory.cuda_vmm import VmmBuffer, VmmTensorGroup, VmmUnavailable

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_vmm_unavailable_without_cuda():
    with pytest.raises(VmmUnavailable, match="CUDA device"):
        VmmBuffer(1024)


@cuda
def test_vmm_keeps_the_address_across_offload():
    w = torch.randn(1000, 333, device="cuda")
    expected = w.clone()
    group = VmmTensorGroup([w])
    ptr, view = w.data_ptr(), w[10:20]
    reg = MemoryRegistry()
    reg.register("w", group, "regenerable", "rollout", "train")
    mgr = ResidencyManager(reg)
    free_before = torch.cuda.mem_get_info()[0]
    mgr.enter("optimizer")  # outside the window: parked on the host, physical pages released
    assert not group.buffer.mapped and torch.cuda.mem_get_info()[0] > free_before
    mgr.enter("rollout")
    assert w.data_ptr() == ptr and torch.equal(w, expected) and torch.equal(view, expected[10:20])
    group.buffer.close()


@cuda
@pytest.mark.parametrize("foreach", [False, True])
def test_streamed_optimizer_cuda_bit_identical(foreach):
    def run(streamed: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
        kw = dict(lr=1e-2, weight_decay=0.1, foreach=foreach)
        opt = (StreamedOptimizer(model.parameters(), torch.optim.AdamW, chunk_bytes=64 * 1024, **kw) if streamed
               else torch.optim.AdamW(model.parameters(), **kw))
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(5):
            model(torch.randn(32, 64, device="cuda", generator=g)).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        return model, opt

    (m1, o1), (m2, o2) = run(False), run(True)
    for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p1, p2)
        assert torch.equal(o1.state[p1]["exp_avg"], o2.state[p2]["exp_avg"].cuda())
    for s in o2.state.values():
        assert s["exp_avg"].device.type == "cpu" and s["exp_avg"].is_pinned()
    assert len(o2.last_step_chunks) > 2


@cuda
def test_saved_tensor_offload_cuda_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)).cuda()
    x = torch.randn(64, 128, device="cuda")
    model(x).pow(2).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    offload = SavedTensorOffload(min_bytes=0)
    with offload.hooks():
        loss = model(x).pow(2).sum()
    offload.prefetch()
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters(), strict=True))


@cuda
def test_ledger_reports_allocator_peaks():
    reg = MemoryRegistry()
    ledger = MemoryLedger(reg, device="cuda")
    mgr = ResidencyManager(reg, ledger)
    mgr.enter("rollout")
    scratch = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    del scratch
    mgr.enter("train")
    m = ledger.metrics()
    assert m["rollplex/mem_peak_rollout_bytes"] >= 64 * 2**20
    assert "rollplex/mem_reserved_bytes" in m

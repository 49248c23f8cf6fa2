"""StreamedOptimizer is bit-identical to the optimizer it wraps, streams in bounded chunks, and checkpoints."""

import copy

import pytest
import torch
from torch import nn

from rollplex_trl.memory import StreamedOptimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.LayerNorm(24), nn.GELU(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 5, bias=False))


def _groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    # Like transformers' Trainer: decay on matrices, none on biases and norms.
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(7, 12, generator=g)
        loss = model(x).pow(2).mean() * 50  # large enough that clipping bites
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()


def _assert_same(m1: nn.Module, m2: nn.Module, o1: torch.optim.Optimizer, o2: torch.optim.Optimizer) -> None:
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters(), strict=True):
        assert torch.equal(p1, p2), f"parameter {name} differs"
        s1, s2 = o1.state[p1], o2.state[p2]
        assert s1.keys() == s2.keys()
        for key in s1:
            assert torch.equal(s1[key], s2[key]), f"state {key} of {name} differs"


def _variant(kind: str) -> dict:
    """torch AdamW's three implementations: the fused kernel (CPU has one in recent torch), foreach, for-loop."""
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[kind]


@pytest.mark.parametrize("kind", ["fused", "foreach", "for-loop"])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_bit_identical_to_adamw_of_the_same_variant(kind, amsgrad, weight_decay):
    kw = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-6, amsgrad=amsgrad, **_variant(kind))
    ref_model, model = _model(), _model()
    ref = torch.optim.AdamW(_groups(ref_model, weight_decay), **kw)
    streamed = StreamedOptimizer(_groups(model, weight_decay), torch.optim.AdamW, chunk_bytes=3000, **kw)
    assert all(g.get("fused") == ref.param_groups[0].get("fused") for g in streamed.inner.param_groups)
    _train(ref_model, ref, steps=6)
    _train(model, streamed, steps=6)
    _assert_same(ref_model, model, ref, streamed)
    assert len(streamed.last_step_chunks) > 2, "chunk size should force several chunks"


def _train_scaled(model: nn.Module, opt: torch.optim.Optimizer, steps: int, inf_at: int) -> torch.amp.GradScaler:
    """Steps through torch's GradScaler (a scale that is not a power of two, so unscaling before the step and
    inside the fused kernel would round differently); step `inf_at` gets an inf gradient and must be skipped."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=2)
    g = torch.Generator().manual_seed(3)
    for i in range(steps):
        loss = model(torch.randn(7, 12, generator=g)).pow(2).mean()
        scaler.scale(loss).backward()
        if i == inf_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler


@pytest.mark.parametrize("amsgrad", [False, True])
def test_grad_scaler_steps_equal_the_fused_optimizer(amsgrad):
    # GradScaler hands a fused optimizer grad_scale/found_inf instead of unscaling the gradients first
    kw = dict(lr=3e-2, weight_decay=0.1, amsgrad=amsgrad, fused=True)
    ref_model, model = _model(), _model()
    ref = torch.optim.AdamW(_groups(ref_model), **kw)
    streamed = StreamedOptimizer(_groups(model), torch.optim.AdamW, chunk_bytes=3000, **kw)
    assert streamed._step_supports_amp_scaling
    s1 = _train_scaled(ref_model, ref, steps=5, inf_at=2)
    s2 = _train_scaled(model, streamed, steps=5, inf_at=2)
    assert s1.get_scale() == s2.get_scale() != 1000.0
    _assert_same(ref_model, model, ref, streamed)
    assert all(s["step"].item() == 4 for s in streamed.state.values()), "the inf step must be skipped"
    assert not hasattr(streamed.inner, "grad_scale") and not hasattr(streamed.inner, "found_inf")


def test_other_per_parameter_optimizer():
    kw = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    ref_model, model = _model(), _model()
    ref = torch.optim.SGD(ref_model.parameters(), **kw)
    streamed = StreamedOptimizer(model.parameters(), torch.optim.SGD, chunk_bytes=2048, **kw)
    _train(ref_model, ref, steps=4)
    _train(model, streamed, steps=4)
    _assert_same(ref_model, model, ref, streamed)


def test_chunks_bounded_ordered_and_state_on_host():
    model = _model()
    params = list(model.parameters())
    chunk = 2048
    opt = StreamedOptimizer(model.parameters(), torch.optim.AdamW, chunk_bytes=chunk, lr=1e-2)
    seen: list = []
    opt.on_chunk = seen.append
    _train(model, opt, steps=2)
    chunks = opt.last_step_chunks
    assert seen[-len(chunks):] == chunks
    # streaming order: every parameter exactly once, in param_groups order
    assert [i for c in chunks for i in c.param_indices] == list(range(len(params)))
    for c in chunks:
        state = sum(2 * params[i].numel() * 4 for i in c.param_indices)
        assert c.state_bytes >= state  # aligned views
        assert c.state_bytes <= chunk or len(c.param_indices) == 1
        # double buffering: this chunk plus at most the next one
        assert c.resident_bytes <= 2 * max(x.state_bytes for x in chunks)
    # between steps the state lives in its homes on the storage device, not in the streaming slots
    slot_ptrs = {s.data_ptr() for s in opt._slots}
    homes = {id(v) for s in opt.state.values() for k, v in s.items() if k != "step"}
    for s in opt.state.values():
        for k, v in s.items():
            if k != "step":
                assert v.device == opt.storage_device
                assert v.untyped_storage().data_ptr() not in slot_ptrs
    _train(model, opt, steps=1, seed=5)
    assert homes == {id(v) for s in opt.state.values() for k, v in s.items() if k != "step"}, \
        "host homes are reused across steps"
    assert opt.state_bytes() == sum(2 * p.numel() * 4 for p in params)


def test_state_dict_round_trip_and_interchange_with_adamw():
    kw = dict(lr=2e-2, weight_decay=0.05)
    ref_model = _model()
    ref = torch.optim.AdamW(_groups(ref_model), **kw)
    _train(ref_model, ref, steps=3)
    ref_state = copy.deepcopy(ref.state_dict())  # state_dict() holds live references
    ref_weights = {k: v.clone() for k, v in ref_model.state_dict().items()}
    _train(ref_model, ref, steps=2, seed=9)

    # resume a StreamedOptimizer from the plain AdamW checkpoint
    model = _model()
    model.load_state_dict(ref_weights)
    streamed = StreamedOptimizer(_groups(model), torch.optim.AdamW, chunk_bytes=4096, **kw)
    streamed.load_state_dict(ref_state)
    for s in streamed.state.values():
        assert all(v.device == streamed.storage_device for v in s.values())
    _train(model, streamed, steps=2, seed=9)
    _assert_same(ref_model, model, ref, streamed)

    # and its own checkpoint resumes into a fresh StreamedOptimizer
    sd = copy.deepcopy(streamed.state_dict())
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    streamed2 = StreamedOptimizer(_groups(model2), torch.optim.AdamW, chunk_bytes=1024, **kw)
    streamed2.load_state_dict(sd)
    assert streamed2.param_groups[0]["lr"] == streamed.param_groups[0]["lr"]
    _train(model, streamed, steps=2, seed=11)
    _train(model2, streamed2, steps=2, seed=11)
    _assert_same(model, model2, streamed, streamed2)


def test_fused_streams_on_any_device_capturable_is_refused():
    # On CUDA the fused kernel runs per chunk as on CPU (the CUDA path has never run: no GPU here); only
    # construction is checked, which touches no device.
    StreamedOptimizer(_model().parameters(), torch.optim.AdamW, fused=True, compute_device="cuda")
    with pytest.raises(ValueError, match="capturable=True.*pass capturable=False"):
        StreamedOptimizer(_model().parameters(), torch.optim.AdamW, capturable=True)

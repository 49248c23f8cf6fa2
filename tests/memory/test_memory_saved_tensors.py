"""Saved-tensor offload: gradients are bit-identical with and without parking the activations on the host."""

import pytest
import torch
from torch import nn

from rollplex_trl.memory import MemoryRegistry, Phase, Placement, ResidencyManager, SavedTensorOffload


@pytest.fixture(scope="module")
def tiny_lm():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    model = Qwen2ForCausalLM(config).eval()  # eval: no dropout, so both runs see the same function
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    return model, ids


def _grads(model, ids, offload: SavedTensorOffload | None, prefetch: bool = False) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if offload is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        with offload.hooks():  # the "prefix forward": everything it saves is parked on the host
            loss = model(input_ids=ids, labels=ids).loss
        assert offload.num_parked > 0
        assert offload.device_bytes() == 0
        if prefetch:
            offload.prefetch()
            assert offload.device_bytes() == offload.nbytes()
    loss.backward()
    if offload is not None:
        offload.release()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("prefetch", [False, True])
def test_grads_bit_identical(tiny_lm, prefetch):
    model, ids = tiny_lm
    ref = _grads(model, ids, None)
    got = _grads(model, ids, SavedTensorOffload(min_bytes=0), prefetch=prefetch)
    assert ref.keys() == got.keys()
    for name in ref:
        same = torch.equal(ref[name], got[name])
        assert same, f"grad of {name} differs with saved-tensor offload"


def test_weights_skipped_and_shared_tensors_parked_once():
    torch.manual_seed(0)
    w1, w2 = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    offload = SavedTensorOffload(min_bytes=0)
    with offload.hooks():
        a = torch.tanh(x)  # tanh saves its output a
        y = (a @ w1).sum() + (a @ w2).sum()  # both matmuls save a (and their weights, which stay put)
    assert offload.num_parked == 1
    assert offload.nbytes() == a.numel() * a.element_size()
    y.backward()
    ref_x, ref_w1 = x.grad.clone(), w1.grad.clone()
    x.grad = w1.grad = None
    a = torch.tanh(x)
    ((a @ w1).sum() + (a @ w2).sum()).backward()
    same = torch.equal(x.grad, ref_x) and torch.equal(w1.grad, ref_w1)
    assert same


def test_small_tensors_stay(tiny_lm):
    model, ids = tiny_lm
    offload = SavedTensorOffload(min_bytes=1 << 30)
    with offload.hooks():
        model(input_ids=ids, labels=ids).loss.backward()
    assert offload.num_parked == 0


def test_as_a_boundary_object(tiny_lm):
    """Registered as boundary state: on the host in rollout and score, back for train, released afterwards."""
    model, ids = tiny_lm
    reg = MemoryRegistry()
    mgr = ResidencyManager(reg)
    offload = SavedTensorOffload(min_bytes=0)
    mgr.enter("rollout")
    with offload.hooks():
        loss = model(input_ids=ids, labels=ids).loss
    reg.register("actor_prefix_activations", offload, "boundary", "rollout", "train",
                 host_phases=["rollout", "score"])
    mgr.settle("actor_prefix_activations")
    assert reg["actor_prefix_activations"].placement is Placement.HOST
    mgr.enter(Phase.SCORE)
    assert offload.device_bytes() == 0
    mgr.enter(Phase.TRAIN)  # prefetch ahead of the backward
    assert reg["actor_prefix_activations"].placement is Placement.DEVICE
    assert offload.device_bytes() == offload.nbytes() > 0
    loss.backward()
    mgr.enter(Phase.OPTIMIZER)
    assert reg["actor_prefix_activations"].placement is Placement.FREED
    assert offload.num_parked == 0

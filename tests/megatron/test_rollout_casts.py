"""Autocast keeps its casts of the frozen rollout model's weights across decode steps
(backends/megatron/rollout_weights.py `autocast_caches_weights`).

Torch caches an autocast cast only for a leaf weight that requires grad, so a frozen model (the Megatron backend's
rollout model) had every weight cast again at every decode step. Counted at the dispatcher: the casts of weights in
three forwards inside one autocast region, with and without the block; the outputs must be bit-identical.
"""

import pytest
import torch
from torch import nn

from rollplex_trl.backends.megatron.rollout_weights import autocast_caches_weights

from helpers import WeightCasts


def _frozen_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16), nn.Linear(16, 8, bias=False))
    return model.requires_grad_(False)


def _decode_steps(model, steps=3):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), WeightCasts(weights) as casts:
        outputs = []
        for _ in range(steps):  # each step enters its own autocast, as accelerate's wrapped forward does
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outputs.append(model(x))
    return outputs, casts.count, len(weights)


@pytest.mark.parametrize("steps", [1, 3])
def test_frozen_weights_are_cast_once_per_autocast_region(steps):
    model = _frozen_model()
    plain, plain_casts, n = _decode_steps(model, steps)
    assert plain_casts == steps * n  # frozen: every weight cast again at every step
    with autocast_caches_weights(model):
        cached, cached_casts, _ = _decode_steps(model, steps)
    assert cached_casts == n  # once per weight for the whole region
    for a, b in zip(plain, cached, strict=True):
        assert torch.equal(a, b)
    assert not any(p.requires_grad for p in model.parameters())  # restored
    assert all(p.grad is None for p in model.parameters())


def test_flags_are_restored_when_the_block_raises_and_trainable_weights_are_left_alone():
    model = _frozen_model()
    model[0].weight.requires_grad_(True)  # a weight that was trainable before stays so after the block
    with pytest.raises(RuntimeError, match="boom"), autocast_caches_weights(model):
        assert all(p.requires_grad for p in model.parameters())
        raise RuntimeError("boom")
    assert [p.requires_grad for p in model.parameters()] == [True] + [False] * 4

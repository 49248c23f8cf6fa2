"""The Megatron backend's gradient norm (backends/megatron/grads.py `clip_grad_norm_tensor_parallel`) against an
fp64 sum of squares, in one process (t = 1; the TP accounting at t = 2 against the hf backend's gradients is
test_megatron_trainer.py's `test_tensor_parallel_2_gradients_equal_hf_per_parameter`).

torch's fp32 `vector_norm` of one long CPU tensor accumulates with an error that grows with its length (2.5e-4
relative at 16M elements): the norm, and through the clip the update, then depend on how the tensors are cut.
"""

from types import SimpleNamespace

import pytest
import torch

from helpers import require

require("megatron.core")

ONE_RANK = SimpleNamespace(tp_size=1, tp_group=None)


def _params(*sizes: int, dtype=torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        p.grad = (torch.randn(n, generator=gen) * 1e-3 + 2e-3).to(dtype)  # an offset: the squares add up one way
        params.append(p)
    return params


def _fp64_norm(params) -> float:
    return sum(p.grad.double().pow(2).sum() for p in params).sqrt().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_of_long_tensors_is_the_fp64_norm(dtype):
    from rollplex_trl.backends.megatron import clip_grad_norm_tensor_parallel

    params = _params(16_000_000, 4096 * 3 + 5, 7, dtype=dtype)  # one long tensor, a few rows and a tail, a short one
    want = _fp64_norm(params)
    got = clip_grad_norm_tensor_parallel(params, None, ONE_RANK)
    assert got.dtype == torch.float32
    # fp32 vector_norm per tensor was 2.5e-4 off here; the returned fp32 value itself rounds at 6e-8
    assert got.item() == pytest.approx(want, rel=2e-7)


def test_clip_scales_by_the_fp64_norm():
    from rollplex_trl.backends.megatron import clip_grad_norm_tensor_parallel

    params = _params(16_000_000, 300)
    before = [p.grad.double().clone() for p in params]
    want = _fp64_norm(params)
    norm = clip_grad_norm_tensor_parallel(params, 1.0, ONE_RANK)
    assert norm.item() == pytest.approx(want, rel=2e-7) and want > 1.0  # clipping active
    coef = 1.0 / (want + 1e-6)
    for p, g in zip(params, before):
        assert torch.allclose(p.grad.double(), g * coef, rtol=1e-6, atol=0), (p.grad.double() / g / coef).max()
    assert _fp64_norm(params) == pytest.approx(1.0, rel=1e-6)

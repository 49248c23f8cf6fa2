"""Split-K Linears (backends/megatron/split_k.py): a row-parallel weight read in place from t shards.

The reference is torch's own nn.Linear on the (out, in) weight the shards make up; the shards lie in one flat
buffer as the weight mapping lays them out (rank k's (out, in / t) shard after rank k - 1's, page-padded), and the
split-K weight is the executor's kind of strided view over it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rollplex_trl.backends.megatron.split_k import SplitKLinear, logical_parameters, to_split_k


def _shards_and_view(weight: torch.Tensor, t: int, gap: int = 37):
    """A flat buffer holding ``weight``'s t column shards one after the other (``gap`` elements between them, as
    page padding leaves) and the (out, t, in / t) strided view of it."""
    out, d_in = weight.shape
    c = d_in // t
    step = out * c + gap
    flat = torch.full((t * step,), float("nan"), dtype=weight.dtype)
    for k in range(t):
        flat[k * step:k * step + out * c] = weight[:, k * c:(k + 1) * c].reshape(-1)
    return flat, torch.as_strided(flat, (out, t, c), (c, step, 1))


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("leading", [(3, 5), (2, 40)], ids=["decode-sized", "prefill-sized"])
def test_split_k_linear_computes_the_full_linear(t, bias, leading):
    """Both kernel shapes (one batched GEMM up to BATCHED_ROWS input rows, a GEMM per shard above)."""
    from rollplex_trl.backends.megatron.split_k import BATCHED_ROWS

    assert (leading[0] * leading[1] <= BATCHED_ROWS) == (leading == (3, 5))
    torch.manual_seed(0)
    ref = nn.Linear(96, 40, bias=bias)
    module = nn.Linear(96, 40, bias=bias)
    module.load_state_dict(ref.state_dict())
    flat, view = _shards_and_view(ref.weight.detach().clone(), t)
    to_split_k(module, view)
    assert isinstance(module, SplitKLinear) and module.weight.data_ptr() == flat.data_ptr()
    x = torch.randn(*leading, 96)
    with torch.no_grad():
        torch.testing.assert_close(module(x), ref(x), rtol=1e-6, atol=1e-6)
        # TRL's default: bf16 autocast (each block cast per call, as the full weight is)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = module(x), ref(x)
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        # the shards are the weight: a write into a shard is the next forward's weight
        flat[: 40 * 96 // t] *= 2
        doubled = ref.weight.detach().clone()
        doubled[:, : 96 // t] *= 2
        torch.testing.assert_close(module(x), nn.functional.linear(x, doubled, ref.bias), rtol=1e-6, atol=1e-6)


def test_state_dict_is_the_plain_weight_and_loading_writes_the_shards():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 16, bias=False))
    weight = model[1].weight.detach().clone()
    flat, view = _shards_and_view(weight, 2)
    to_split_k(model[1], view)
    state = model.state_dict()
    assert state["1.weight"].shape == (16, 64) and torch.equal(state["1.weight"], weight)
    assert logical_parameters(model)["1.weight"].shape == (16, 64)
    assert torch.equal(logical_parameters(model)["0.weight"], model[0].weight)

    new = torch.randn(16, 64)
    model.load_state_dict({**state, "1.weight": new}, strict=True)  # e.g. resuming from a checkpoint
    assert model[1].weight.data_ptr() == flat.data_ptr()  # still the view: the load wrote through it
    _, expected = _shards_and_view(new, 2)
    assert torch.equal(model[1].weight, expected)
    assert torch.equal(flat[: 16 * 32], new[:, :32].reshape(-1))  # rank 0's shard holds the loaded columns
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict({**state, "1.weight": torch.randn(16, 63)})


def test_to_split_k_refuses_what_it_cannot_serve():
    _, view = _shards_and_view(torch.randn(16, 64), 2)

    class Custom(nn.Linear):
        pass

    with pytest.raises(TypeError, match="plain nn.Linear"):
        to_split_k(Custom(64, 16), view)
    with pytest.raises(ValueError, match=r"\(out, t, in / t\)"):
        to_split_k(nn.Linear(64, 8), view)


def test_the_plan_binds_exactly_the_row_parallel_weights_and_checks_their_modules(tiny_vl_path):
    """The mapping's plan at t = 2 with views (pure planning, no processes): its `view` tensors are o_proj and
    down_proj of every layer, each a whole plain nn.Linear weight; a module the split-K Linear cannot replace is
    reported (then the mapping copies those weights instead)."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from rollplex_trl.backends.megatron import mapped_weights
    from rollplex_trl.backends.megatron.weights import sharding_options
    from rollplex_trl.sharding import model_spec_from_config, plan_sharding

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl_path, dtype=torch.float32)
    spec = model_spec_from_config(AutoConfig.from_pretrained(tiny_vl_path))
    plan = plan_sharding(spec, mapped_weights.mapping_options(sharding_options(2), 4, 4096, views=True))
    bindings = mapped_weights.plan_bindings(spec, plan, 0, dict(model.named_parameters()))
    split = {b.hf_name for b in bindings if b.split_k}
    layers = model.config.text_config.num_hidden_layers
    assert split == {f"model.language_model.layers.{i}.{m}.weight" for i in range(layers)
                     for m in ("self_attn.o_proj", "mlp.down_proj")}
    assert mapped_weights._split_k_problem(plan, bindings, 0, model) is None
    without = plan_sharding(spec, mapped_weights.mapping_options(sharding_options(2), 4, 4096))
    assert not any(b.split_k for b in mapped_weights.plan_bindings(spec, without, 0, dict(model.named_parameters())))

    class Wrapped(nn.Linear):  # e.g. a quantised or adapter Linear
        pass

    model.model.language_model.layers[0].mlp.down_proj.__class__ = Wrapped
    assert "not the weight of a plain nn.Linear" in mapped_weights._split_k_problem(plan, bindings, 0, model)


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("leading", [(3, 5), (2, 40)], ids=["decode-sized", "prefill-sized"])
def test_rollout_casts_are_autocasts_own_made_once(t, leading):
    """Within a rollout (`autocast_caches_weights`) a split-K Linear keeps the bf16 casts of the weight views its
    GEMMs take: outputs bit-equal to autocast's per-call casts, and the views cast once over several calls (the
    weights' values are those of the rollout's start: the block is never open across an optimizer step)."""
    from rollplex_trl.backends.megatron.rollout_weights import autocast_caches_weights

    torch.manual_seed(0)
    module = nn.Linear(96, 40, bias=True)
    _, view = _shards_and_view(module.weight.detach().clone(), t)
    to_split_k(module, view)
    x = torch.randn(*leading, 96)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        per_call = [module(x) for _ in range(3)]
        with autocast_caches_weights(module):
            kept = [module(x) for _ in range(3)]
            casts = dict(module._rollout_casts)
    assert all(torch.equal(a, b) for a, b in zip(per_call, kept, strict=True))
    assert len(casts) == (1 if leading == (3, 5) else t)  # one per view the kernel takes, whatever the calls
    assert all(c.dtype == torch.bfloat16 for c in casts.values())
    assert module._rollout_casts is None  # dropped with the block

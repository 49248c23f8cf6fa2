"""Row-parallel weights read in place by the transformers rollout model: a split-K Linear.

At t > 1 Megatron splits a row-parallel weight (o_proj, down_proj) over the TP ranks along its input features:
rank k holds W[:, k*c:(k+1)*c] as one contiguous (out, c) shard. In the transformers (out, in) layout every row
holds a piece of every rank's shard, so no stitching of pages makes it one plain tensor (without views the plan
classifies it `copy`, and the mapping rebuilds it after every optimizer step). The plan's `view` class describes
it instead as one strided tensor (out, t, c) over the stitched shards: ``[:, k, :]`` is rank k's shard, a plain
(out, c) matrix. `SplitKLinear` computes ``y = sum_k x[..., k*c:(k+1)*c] @ W_k^T`` from that view (the blocked
product `sharding/views.view_linear` defines, in two kernel shapes: one batched GEMM for decode-sized inputs, a
GEMM per shard accumulated by addmm for prefill-sized ones, each measured at least as fast as the alternatives on
CPU): the sum F.linear computes, grouped by shard as Megatron's row-parallel layer groups it (the float rounding of
the last bits differs, as between two GEMM kernels), with nothing copied after a step and no second copy held.

The module stays an `nn.Linear` whose `weight` Parameter is the 3-D view: `state_dict()` gives the (out, in)
weight (a copy, so checkpoints are plain transformers checkpoints) and `load_state_dict()` takes one, written
through the view (into the training shards, which is what loading a checkpoint into this model means). Code that
reads `.weight` directly sees the 3-D view (a loud shape error, never stale values); `logical_parameters(model)`
gives every parameter in its transformers shape.
"""

from __future__ import annotations

import torch
from torch import nn

# Up to this many input rows (a decode step's batch) one batched GEMM over the shards; above, one GEMM per shard.
# Measured on 2 CPU cores (small preset shapes, t = 2, fp32): at 8 rows bmm 124-207 us vs per-shard GEMMs
# 206-357 us vs the unsplit F.linear 142-281 us; at 2400 rows per-shard GEMMs 16-36 ms vs bmm 19-37 ms.
BATCHED_ROWS = 64


class SplitKLinear(nn.Linear):
    """An `nn.Linear` whose weight is a strided (out, t, c) view of t shards (see the module docstring). Made by
    `to_split_k` (a class swap: the module keeps its name, hooks and place in the model)."""

    # Within `rollout_weights.autocast_caches_weights` (a rollout: the weights cannot change), the autocast casts of
    # the weight views the GEMMs below take, by (dtype, view); None elsewhere. Autocast's own cache never holds
    # them: it keeps the casts of leaf tensors only, and these are views (a permute, a shard's transpose).
    _rollout_casts: dict[tuple[torch.dtype, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight  # (out, t, c)
        t, c = w.shape[1], w.shape[2]
        rows = x.reshape(-1, t * c)
        if rows.shape[0] <= BATCHED_ROWS:
            # decode-sized: one batched GEMM over the t shards, (t, rows, c) @ (t, c, out), then the sum over
            # shards (w.permute is a view: every shard is a transposed plain matrix to bmm)
            y = torch.bmm(rows.view(-1, t, c).transpose(0, 1), self._operand(-1, w.permute(1, 2, 0), x)).sum(0)
        else:
            # prefill-sized: a GEMM per shard on column slices of the input (strided, as BLAS takes them), each
            # accumulated into the output by the next one's addmm
            y = torch.mm(rows[:, :c], self._operand(0, w[:, 0].t(), x))
            for k in range(1, t):
                y = torch.addmm(y, rows[:, k * c:(k + 1) * c], self._operand(k, w[:, k].t(), x))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _operand(self, key: int, view: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``view`` of the weight as the GEMM takes it; within a rollout under autocast, its cast to the autocast
        dtype, made once per rollout: the very cast (`to`, same view, same layout) autocast makes at every call."""
        device = x.device.type
        if self._rollout_casts is None or not torch.is_autocast_enabled(device) or not view.is_floating_point():
            return view
        dtype = torch.get_autocast_dtype(device)
        if view.dtype == dtype:
            return view
        cast = self._rollout_casts.get((dtype, key))
        if cast is None:
            cast = self._rollout_casts[(dtype, key)] = view.detach().to(dtype)
        return cast

    def full_weight(self) -> torch.Tensor:
        """The (out, in) weight (a copy: the view has no such strides)."""
        return self.weight.reshape(self.out_features, self.in_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.full_weight() if keep_vars else self.full_weight().detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        value = state_dict.get(key)
        if value is not None and tuple(value.shape) == (self.out_features, self.in_features):
            state_dict[key] = value.reshape(self.weight.shape)  # (out, in) -> (out, t, c): a view of the input
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def to_split_k(module: nn.Module, weight: torch.Tensor) -> None:
    """Make ``module`` (an `nn.Linear` holding the (out, in) weight) compute from ``weight``, its (out, t, c)
    strided view; the values must be equal already (the caller checks)."""
    if not isinstance(module, nn.Linear) or type(module) not in (nn.Linear, SplitKLinear):
        raise TypeError(f"split-K views replace a plain nn.Linear, not {type(module).__name__}")
    if weight.dim() != 3 or weight.shape[0] != module.out_features or \
            weight.shape[1] * weight.shape[2] != module.in_features:
        raise ValueError(f"a split-K view of a ({module.out_features}, {module.in_features}) weight must be "
                         f"(out, t, in / t), not {tuple(weight.shape)}")
    module.__class__ = SplitKLinear
    module.weight.data = weight


def logical_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """``named_parameters()`` with every split-K weight in its (out, in) shape (those are copies)."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    for name, module in model.named_modules():
        if isinstance(module, SplitKLinear):
            out[f"{name}.weight" if name else "weight"] = module.full_weight()
    return out

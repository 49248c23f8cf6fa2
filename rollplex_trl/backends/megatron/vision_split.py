"""The vision tower's items (images, videos) spread over the tensor-parallel ranks instead of repeated on each.

Why: `MegatronPolicy` replicates the HF vision tower on the TP ranks (Megatron-Bridge's convention), so every rank
runs the whole tower on every item of the batch. For video at large t that is most of a rank's prompt work
(docs/megatron.md: about 10 TFLOP per rank for a Video-R1-sized clip on Qwen2.5-VL-7B, against 3.5 for the LLM's
share of the prompt at t = 8).

How (`rollplex_split_vision`): TP rank r runs the tower on items r, r + t, r + 2t, ... of each vision input
(round robin over the rows of `image_grid_thw` / `video_grid_thw`); the features of all items are gathered over the
TP group as a sum of zero-padded buffers (exact: x + 0 = x), in the original item order. In the backward each rank
keeps its items' rows of the features' gradient: that gradient is the same on every rank, because the decoder's
input is replicated and megatron all-reduces every gradient that reaches it. The tower's parameter gradients then
hold this rank's items only; `grads.sum_vision_gradients` adds them over the TP group once per optimizer step, before
the replicated gradients are shared and clipped (`MegatronBackend.grad_norm`).

Exact up to rounding: the tower computes each item on its own (attention within the item, everything else row by
row), so only the order in which the items' gradient contributions are summed changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class VisionSplit:
    """This rank's share of the vision items and the TP group's in-place SUM all-reduce."""

    tp_rank: int
    tp_size: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]

    def items(self, count: int) -> list[int]:
        """The item indices this rank runs the tower on (round robin: the same answer on every rank)."""
        return list(range(self.tp_rank, count, self.tp_size))


class _GatherItems(torch.autograd.Function):
    """Forward: this rank's feature rows placed into the whole batch's, summed over TP. Backward: this rank's rows."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, rows: torch.Tensor, total: int, all_reduce) -> torch.Tensor:
        full = local.new_zeros(total, local.size(-1))
        full.index_copy_(0, rows, local)
        all_reduce(full)
        ctx.save_for_backward(rows)
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows), None, None, None


def _ranges(starts: torch.Tensor, lengths: torch.Tensor, items: list[int]) -> torch.Tensor:
    pieces = [torch.arange(int(starts[i]), int(starts[i] + lengths[i])) for i in items]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def split_vision_features(visual: nn.Module, pixels: torch.Tensor, grid: torch.Tensor, split: VisionSplit, *,
                          dtype: torch.dtype, hidden: int) -> torch.Tensor:
    """The tower's features of every item (``[sum of merged tokens, hidden]`` in ``dtype``), this rank having run
    it on its items only. A collective over the TP group: every rank calls it with the same ``grid``.

    Qwen2.5-VL layout: item i has ``t * h * w`` rows of ``pixels`` (its grid row) and ``t * h * w / merge**2``
    feature rows, both in item order."""
    merge = int(getattr(visual, "spatial_merge_size", 2))
    patches = grid.prod(-1).cpu()
    if int(patches.sum()) != pixels.size(0):  # every rank would slice the wrong rows: say which tensors disagree
        raise ValueError(f"the vision inputs disagree: the grid_thw rows {grid.tolist()} describe {int(patches.sum())} "
                         f"patch rows, the pixel values have {pixels.size(0)}; pass each item's pixel rows in order")
    features = patches // merge**2
    pixel_starts = torch.cumsum(patches, 0) - patches
    feature_starts = torch.cumsum(features, 0) - features
    mine = split.items(grid.size(0))
    rows = _ranges(feature_starts, features, mine).to(pixels.device)
    if mine:
        local_pixels = pixels.index_select(0, _ranges(pixel_starts, patches, mine).to(pixels.device))
        local = visual(local_pixels.type(visual.dtype), grid_thw=grid[mine]).pooler_output.to(dtype)
    else:  # fewer items than ranks: nothing to run here, the peers' rows arrive through the sum
        local = torch.zeros(0, hidden, dtype=dtype, device=pixels.device)
    return _GatherItems.apply(local, rows, int(features.sum()), split.all_reduce)

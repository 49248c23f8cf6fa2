"""The live weight sync's view of vLLM's parameters: copy targets, alias views and copy buckets.

Which HF tensors fill which vLLM parameter, in which order and which slice of them a tensor-parallel rank holds is
not decided here: `rollplex_trl.sharding` declares it once for every framework (`sharding/models.py`'s table, composed
by `sharding/layouts.py`), and `vllm_targets.py` reads each `Target`'s `SlicePair`s from it. This module holds what
the sync does with them: check that they tile the parameter, alias trainer tensors into vLLM's storage, and group
parameters into copy buckets.

This module imports neither vLLM nor transformers: it is unit-tested with plain tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rollplex_trl.memory.storage import group_into_buckets  # noqa: F401 (re-exported: weight_sync, tests)
from rollplex_trl.sharding.layouts import SlicePair, shape_2d


@dataclass
class Target:
    """One vLLM parameter in its *unpacked* layout (the layout its weight_loader writes)."""

    name: str
    module_name: str
    attr: str  # "weight" or "bias"
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[SlicePair] = field(default_factory=list)
    # vLLM repacked this layer after loading (CPU oneDNN/SGL kernels): the live parameter is empty or not read by
    # the kernel, so new values must be staged and the layer's post-load processing run again.
    repacked: bool = False
    # The repacked layer keeps `layer.weight` (vLLM's embedding/LM head on CPU): write into it, then reprocess.
    keeps_weight: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def check_tiling(target: Target, src_shapes: dict[str, Sequence[int]]) -> None:
    """Fail loudly unless the pieces fit `target` and the sources; a mismatch here means vLLM's layout changed."""
    dst_shape = shape_2d(target.shape)
    for p in target.pieces:
        src_shape = shape_2d(src_shapes[p.src_name])
        if len(src_shape) != len(dst_shape):
            raise ValueError(f"{target.name}: {p.src_name} has shape {src_shape}, target {dst_shape}")
        for d, (s, t) in enumerate(zip(src_shape, dst_shape, strict=True)):
            if d == p.dim:
                if p.src_start + p.length > s or p.dst_start + p.length > t:
                    raise ValueError(f"{target.name}: piece {p} does not fit {src_shape} -> {dst_shape}")
            elif s != t:
                raise ValueError(f"{target.name}: {p.src_name} {src_shape} and target {dst_shape} differ "
                                 f"outside dimension {p.dim}")


# ----------------------------------------------------------------------------------------------------------------
# Aliasing: trainer tensors become views of vLLM's parameter storage
# ----------------------------------------------------------------------------------------------------------------

def alias_blockers(target: Target, src: torch.Tensor, dst: torch.Tensor | None, piece: SlicePair,
                   shared_source: bool) -> list[str]:
    """Why HF tensor `src` cannot become the view `piece.dst_view(dst)` of vLLM's storage (empty list: it can)."""
    reasons = []
    if target.repacked:
        reasons.append("vLLM repacks this layer's weight after loading (CPU backend: oneDNN/SGL kernels), so its "
                       "kernel never reads an aliasable tensor")
    if dst is None:
        reasons.append("vLLM's parameter is not materialised")
        return reasons
    if src.dtype != dst.dtype:
        reasons.append(f"dtype differs (trainer {src.dtype}, vLLM {dst.dtype})")
    if src.device != dst.device:
        reasons.append(f"device differs (trainer {src.device}, vLLM {dst.device})")
    if piece.dim != 0 or not piece.covers_whole_source(src.shape):
        reasons.append("vLLM holds only a slice of it (tensor parallelism) or a non-row block")
    if shared_source:
        reasons.append("it feeds more than one vLLM parameter (tied weights)")
    return reasons


def install_alias(param: torch.nn.Parameter, dst: torch.Tensor, piece: SlicePair) -> None:
    """Make trainer parameter `param` a view of its block in vLLM's parameter `dst`, keeping its current values.

    Direction matters: the trainer adopts vLLM's storage, never the other way round, so vLLM's parameter addresses
    (captured by CUDA graphs, mapped by its sleep-mode allocator) never change. Row blocks of a contiguous tensor are
    contiguous, so the trainer's kernels, its optimizer state and its gradients keep their layout. The Parameter
    object is the same one, so optimizer references stay valid.
    """
    view = piece.dst_view(dst)
    if view.numel() != param.numel() or shape_2d(view.shape) != shape_2d(param.shape):
        raise ValueError(f"alias view {tuple(view.shape)} does not match trainer tensor {tuple(param.shape)}")
    view = view.view(param.shape)  # a row block is contiguous: the trainer keeps its own shape (e.g. a Conv3d's)
    with torch.no_grad():
        view.copy_(param.detach())
    param.data = view


def is_alias_of(src: torch.Tensor, dst: torch.Tensor, piece: SlicePair) -> bool:
    """Whether `src` already is the block `piece` of `dst` (same storage, offset, size and layout)."""
    view = piece.dst_view(dst)
    return (src.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
            and src.storage_offset() == view.storage_offset() and src.numel() == view.numel()
            and src.is_contiguous() and view.is_contiguous())

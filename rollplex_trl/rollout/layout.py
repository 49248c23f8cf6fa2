"""Where each trainer (HF) tensor lands in vLLM's parameters: pieces, copy targets and alias views.

vLLM stores some HF tensors fused (`q_proj`/`k_proj`/`v_proj` -> rows of `qkv_proj`, `gate_proj`/`up_proj` -> rows
of `gate_up_proj`) and, under tensor parallelism, keeps only its rank's rows or columns. A `Piece` says which block
of one HF tensor fills which block of one vLLM parameter; both blocks are `narrow`s along the same dimension, which
is all that vLLM's own loaders do for the decoder layers of the Qwen2/Llama families (and Qwen2.5-VL's language
model). The pieces are derived once from vLLM's module classes and attributes (`describe_target`), so the rank's
slicing comes from the same numbers vLLM's `weight_loader`s use.

This module imports neither vLLM nor transformers: the layout rules are unit-tested with plain tensors and fake
modules.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

K = TypeVar("K")  # what group_into_buckets groups: tensor names, indices


@dataclass(frozen=True)
class Piece:
    """`src.narrow(dim, src_start, length)` of HF tensor `src_name` is copied to `dst.narrow(dim, dst_start, length)`
    of vLLM parameter `dst_name` (the remaining dimensions are equal and taken whole)."""

    src_name: str
    dst_name: str
    dim: int
    src_start: int
    dst_start: int
    length: int

    def src_view(self, src: torch.Tensor) -> torch.Tensor:
        return src.narrow(self.dim, self.src_start, self.length)

    def dst_view(self, dst: torch.Tensor) -> torch.Tensor:
        return dst.narrow(self.dim, self.dst_start, self.length)

    def covers_whole_source(self, src_shape: Sequence[int]) -> bool:
        return self.src_start == 0 and self.length == src_shape[self.dim]


@dataclass
class Target:
    """One vLLM parameter in its *unpacked* layout (the layout its weight_loader writes)."""

    name: str
    module_name: str
    attr: str  # "weight" or "bias"
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)
    # vLLM repacked this layer after loading (CPU oneDNN/SGL kernels): the live parameter is empty or not read by
    # the kernel, so new values must be staged and the layer's post-load processing run again.
    repacked: bool = False
    # The repacked layer keeps `layer.weight` (vLLM's embedding/LM head on CPU): write into it, then reprocess.
    keeps_weight: bool = False

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _class_names(module: object) -> set[str]:
    # Class names over the MRO rather than isinstance: keeps vLLM out of this module, and lets tests use fakes.
    return {c.__name__ for c in type(module).__mro__}


# ----------------------------------------------------------------------------------------------------------------
# Per-layer rules (mirroring vLLM's weight_loaders in model_executor/layers/linear.py and vocab_parallel_embedding.py)
# ----------------------------------------------------------------------------------------------------------------

def qkv_pieces(module: object, src: str, dst: str, shard: str, src_shape: Sequence[int]) -> list[Piece]:
    """QKVParallelLinear: the rank holds [q_rank; k_rank; v_rank] rows; KV heads are replicated when tp > kv heads."""
    hs, v_hs = module.head_size, getattr(module, "v_head_size", module.head_size)
    nh, nkv = module.num_heads, module.num_kv_heads
    replicas = getattr(module, "num_kv_head_replicas", 1)
    rank = module.tp_rank
    if shard == "q":
        offset, size, start = 0, nh * hs, rank * nh * hs
    elif shard == "k":
        offset, size, start = nh * hs, nkv * hs, (rank // replicas) * nkv * hs
    elif shard == "v":
        offset, size, start = (nh + nkv) * hs, nkv * v_hs, (rank // replicas) * nkv * v_hs
    else:
        raise ValueError(f"{dst}: unknown QKV shard {shard!r}")
    return [Piece(src, dst, 0, start, offset, size)]


def merged_column_pieces(module: object, src: str, dst: str, shard: int) -> list[Piece]:
    """MergedColumnParallelLinear: the rank holds [gate_rank; up_rank] (each output size / tp rows)."""
    tp = module.tp_size
    local = [s // tp for s in module.output_sizes]
    offset = sum(local[:shard])
    return [Piece(src, dst, 0, module.tp_rank * local[shard], offset, local[shard])]


def row_parallel_pieces(module: object, src: str, dst: str, attr: str, src_shape: Sequence[int]) -> list[Piece]:
    """RowParallelLinear: the weight is split along its input dimension; the bias is whole on every rank."""
    if attr == "bias":
        return [Piece(src, dst, 0, 0, 0, src_shape[0])]
    local = module.input_size_per_partition
    return [Piece(src, dst, 1, module.tp_rank * local, 0, local)]


def column_parallel_pieces(module: object, src: str, dst: str) -> list[Piece]:
    local = module.output_size_per_partition
    return [Piece(src, dst, 0, module.tp_rank * local, 0, local)]


def vocab_pieces(module: object, src: str, dst: str, src_shape: Sequence[int]) -> list[Piece]:
    """(Parallel)VocabParallelEmbedding / ParallelLMHead: the rank's rows of the original vocabulary, at the top of
    its (padded) shard; padding rows are left as vLLM initialised them."""
    idx = module.shard_indices
    start, end = idx.org_vocab_start_index, min(idx.org_vocab_end_index, src_shape[0])
    return [Piece(src, dst, 0, start, 0, max(0, end - start))]


def describe_pieces(module: object, src: str, src_shape: Sequence[int], dst: str, attr: str,
                    shard: str | int | None) -> list[Piece]:
    """The pieces of HF tensor `src` inside vLLM parameter `dst` (= `<module>.<attr>`)."""
    names = _class_names(module)
    if "QKVParallelLinear" in names and shard is not None:
        return qkv_pieces(module, src, dst, str(shard), src_shape)
    if "MergedColumnParallelLinear" in names and shard is not None:
        return merged_column_pieces(module, src, dst, int(shard))
    if "RowParallelLinear" in names:
        return row_parallel_pieces(module, src, dst, attr, src_shape)
    if "VocabParallelEmbedding" in names:  # ParallelLMHead subclasses it
        return vocab_pieces(module, src, dst, src_shape)
    if "ColumnParallelLinear" in names and attr in ("weight", "bias"):
        return column_parallel_pieces(module, src, dst)
    if shard is not None:
        raise ValueError(f"{dst}: HF tensor {src} is a shard ({shard!r}) of a {type(module).__name__}, "
                         "a layer whose fused layout is not known here")
    # Replicated (norms, ReplicatedLinear, ...): the whole tensor.
    return [Piece(src, dst, 0, 0, 0, src_shape[0] if src_shape else 1)]


def check_tiling(target: Target, src_shapes: dict[str, Sequence[int]]) -> None:
    """Fail loudly unless the pieces fit `target` and the sources; a mismatch here means vLLM's layout changed."""
    for p in target.pieces:
        src_shape = list(src_shapes[p.src_name])
        if len(src_shape) != len(target.shape):
            raise ValueError(f"{target.name}: {p.src_name} has shape {tuple(src_shape)}, target {target.shape}")
        for d, (s, t) in enumerate(zip(src_shape, target.shape, strict=True)):
            if d == p.dim:
                if p.src_start + p.length > s or p.dst_start + p.length > t:
                    raise ValueError(f"{target.name}: piece {p} does not fit {tuple(src_shape)} -> {target.shape}")
            elif s != t:
                raise ValueError(f"{target.name}: {p.src_name} {tuple(src_shape)} and target {target.shape} differ "
                                 f"outside dimension {p.dim}")


# ----------------------------------------------------------------------------------------------------------------
# Aliasing: trainer tensors become views of vLLM's parameter storage
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AliasDecision:
    aliased: list[str]  # HF tensor names now stored inside vLLM parameters
    refused: dict[str, str]  # HF tensor name -> why it is copied instead


def alias_blockers(target: Target, src: torch.Tensor, dst: torch.Tensor | None, piece: Piece,
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


def install_alias(param: torch.nn.Parameter, dst: torch.Tensor, piece: Piece) -> None:
    """Make trainer parameter `param` a view of its block in vLLM's parameter `dst`, keeping its current values.

    Direction matters: the trainer adopts vLLM's storage, never the other way round, so vLLM's parameter addresses
    (captured by CUDA graphs, mapped by its sleep-mode allocator) never change. Row blocks of a contiguous tensor are
    contiguous, so the trainer's kernels, its optimizer state and its gradients keep their layout. The Parameter
    object is the same one, so optimizer references stay valid.
    """
    view = piece.dst_view(dst)
    if view.shape != param.shape:
        raise ValueError(f"alias view {tuple(view.shape)} does not match trainer tensor {tuple(param.shape)}")
    with torch.no_grad():
        view.copy_(param.detach())
    param.data = view


def is_alias_of(src: torch.Tensor, dst: torch.Tensor, piece: Piece) -> bool:
    """Whether `src` already is the block `piece` of `dst` (same storage, offset, shape and strides)."""
    view = piece.dst_view(dst)
    return (src.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
            and src.storage_offset() == view.storage_offset() and src.shape == view.shape
            and src.stride() == view.stride())


def group_into_buckets(sizes: Iterable[tuple[K, int]], bucket_bytes: int) -> list[list[K]]:
    """Consecutive groups of keys (names, indices) whose byte sizes add up to at most `bucket_bytes` (a larger item
    is alone)."""
    buckets: list[list[K]] = []
    current: list[K] = []
    used = 0
    for name, size in sizes:
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        buckets.append(current)
    return buckets

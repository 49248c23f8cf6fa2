"""The layout algebra: how a framework builds one tensor-parallel rank's parameter out of Hugging Face tensors.

Every layout here is *declarative*, in the spirit of vLLM's ``weight_loader``s: a parameter names the HF tensors it
is made of (its sources), how their rows are packed, and along which dimension it is split over TP ranks. One
function (:func:`shard_index`) turns any such description into index maps, for any TP size and rank:

    local[a, b] = V[rows[a], cols[b]]      V = the sources, flattened to 2-D and stacked along dim 0

Row ids past the real rows of V are vocabulary padding rows (``V`` is extended with zero rows; padding row ``i``
has the same id in every framework, so two frameworks padded to the same size agree on it).

Every layout in Megatron-Core and vLLM for Qwen2 / Qwen2.5-VL is a *separable* map like this: a row selection times a
column selection. That is what keeps the algebra small: three row packings and one split choice.

- :class:`Concat`: rows of all sources in order, then one contiguous split (``ColumnParallelLinear``,
  ``VocabParallelEmbedding``, ``RowParallelLinear`` when the split is on columns).
- :class:`PerRank`: every source is split on its own and a rank holds ``[s0_k; s1_k; ...]`` (vLLM's
  ``MergedColumnParallelLinear`` and ``QKVParallelLinear``, with KV-head replication when there are fewer KV heads
  than ranks; Megatron's ``linear_fc1`` with ``partition_stride = 2``).
- :class:`GroupInterleave`: Megatron's fused QKV: for every KV group ``g``, ``[q heads of g; k_g; v_g]``, then one
  contiguous split (a group may straddle ranks when there are fewer groups than ranks, as Megatron-Core >= 0.12
  allows).

The same index maps drive both consumers: the sharing planner (:mod:`.plan`) and the live weight sync into vLLM
(``rollplex_trl.rollout.vllm_targets``), which reads them as :class:`SlicePair` lists (:func:`slice_pairs`): plain
``narrow`` copies, since every vLLM layout is a row selection of whole rows or a column chunk of whole columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


class LayoutError(ValueError):
    """A layout cannot be built (a dimension does not divide over the ranks); the message names the tensor."""


@dataclass(frozen=True)
class HFSourceSpec:
    """One HF tensor, or one equal part of a fused HF tensor, that a parameter kind is built from.

    ``unit`` names the dimension that sets indivisible row blocks (``"head_dim"`` for q/k/v: a split never cuts a
    head); ``None`` means single rows. ``part = (i, n)`` selects row chunk ``i`` of ``n`` of the HF tensor (the
    vision tower stores q, k and v fused in one ``attn.qkv`` tensor).
    """

    suffix: str
    unit: str | None = None
    part: tuple[int, int] = (0, 1)


@dataclass(frozen=True)
class Concat:
    """Rows of the sources in order; a column split then takes one contiguous chunk per rank."""


@dataclass(frozen=True)
class PerRank:
    """Each source is split over the ranks on its own; rank k holds ``[s0_k; s1_k; ...]``.

    ``replicate``: a source with fewer units (heads) than ranks is replicated, rank k taking unit
    ``k // (tp / units)`` (vLLM's ``num_kv_head_replicas``).
    """

    replicate: bool = False


@dataclass(frozen=True)
class GroupInterleave:
    """Megatron's fused QKV over sources (q, k, v): for each KV group g, ``[q heads of g; k_g; v_g]``."""


Packing = Concat | PerRank | GroupInterleave


@dataclass(frozen=True)
class ShardSpec:
    """One framework parameter: which of its kind's sources, how packed, and the split dimension.

    ``split``: 0 = column-parallel (split the output rows), 1 = row-parallel (split the input columns), None =
    replicated on every rank. ``vocab``: the rows are padded with the framework's vocabulary rule before splitting.
    """

    name: str
    sources: tuple[int, ...]
    packing: Packing = Concat()
    split: int | None = None
    vocab: bool = False


@dataclass(frozen=True)
class VocabPadding:
    """A framework's vocabulary padding rule: round up to ``multiple`` (times the TP size when ``times_tp``)."""

    multiple: int = 1
    times_tp: bool = False

    def padded(self, rows: int, tp: int) -> int:
        m = max(1, self.multiple) * (tp if self.times_tp else 1)
        return -(-rows // m) * m


def _chunk(ids: np.ndarray, n: int, k: int, what: str, noun: str = "rows") -> np.ndarray:
    if len(ids) % n:
        raise LayoutError(f"{what}: {len(ids)} {noun} cannot be split evenly over {n} tensor-parallel ranks")
    size = len(ids) // n
    return ids[k * size:(k + 1) * size]


def _units(ids: np.ndarray, unit: int) -> np.ndarray:
    """Rows grouped by unit: shape (units, unit)."""
    return ids.reshape(-1, unit)


def _per_rank(srcs: list[np.ndarray], units: list[int], tp: int, rank: int, replicate: bool, what: str) -> np.ndarray:
    parts = []
    for ids, unit in zip(srcs, units):
        blocks = _units(ids, unit)
        n = len(blocks)
        if n >= tp or not replicate:
            noun = f"heads ({unit} rows each)" if unit > 1 else "rows"
            parts.append(_chunk(blocks, tp, rank, what, noun).reshape(-1))
        else:
            if tp % n:
                raise LayoutError(f"{what}: {n} heads cannot be replicated evenly over {tp} ranks")
            parts.append(blocks[rank // (tp // n)])
    return np.concatenate(parts)


def _group_interleave(srcs: list[np.ndarray], units: list[int], tp: int, what: str) -> np.ndarray:
    if len(srcs) != 3:
        raise LayoutError(f"{what}: a group-interleaved QKV needs exactly three sources (q, k, v)")
    q, k, v = (_units(ids, u) for ids, u in zip(srcs, units))
    groups = len(k)
    if len(q) % groups:
        raise LayoutError(f"{what}: {len(q)} query heads are not a multiple of {groups} KV groups")
    if len(q) % tp or (groups % tp and tp % groups):
        raise LayoutError(f"{what}: {len(q)} query heads / {groups} KV groups cannot be split over {tp} ranks "
                          "(Megatron-Core needs heads % tp == 0 and groups % tp == 0 or tp % groups == 0)")
    per = len(q) // groups
    return np.concatenate([np.concatenate([q[g * per:(g + 1) * per].reshape(-1), k[g], v[g]])
                           for g in range(groups)])


def shard_index(spec: ShardSpec, source_rows: list[np.ndarray], units: list[int], num_cols: int, tp: int,
                rank: int, padding: VocabPadding | None = None,
                name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Index maps ``(rows, cols)`` of rank ``rank`` of ``tp`` for one parameter (see the module docstring).

    ``source_rows[i]``: the row ids in V of the spec's i-th source; ``units[i]`` its unit in rows.
    ``tp = 1`` gives the full, unsplit framework tensor (also what a replicated parameter holds). ``name`` (the
    full parameter name) goes into error messages.
    """
    what = name or spec.name
    split_rows = spec.split == 0
    n = tp if split_rows else 1
    k = rank if split_rows else 0
    match spec.packing:
        case PerRank(replicate=replicate):
            rows = _per_rank(source_rows, units, n, k, replicate, what)
        case GroupInterleave():
            rows = _chunk(_group_interleave(source_rows, units, n, what), n, k, what)
        case Concat():
            rows = np.concatenate(source_rows)
            if spec.vocab and padding is not None:
                total = padding.padded(len(rows), n)
                # Padding ids continue after the last real id, so equal padded sizes mean equal padding rows.
                rows = np.concatenate([rows, np.arange(rows[-1] + 1, rows[-1] + 1 + total - len(rows))])
            rows = _chunk(rows, n, k, what)
        case _:
            raise LayoutError(f"{what}: unknown packing {spec.packing!r}")
    cols = np.arange(num_cols)
    if spec.split == 1:
        cols = _chunk(cols, tp, rank, what)
    return rows.astype(np.int64), cols.astype(np.int64)


# ------------------------------------------------------------------------------------- index maps -> narrow copies
@dataclass(frozen=True)
class SlicePair:
    """``src.narrow(dim, src_start, length)`` of HF tensor ``src_name`` is ``dst.narrow(dim, dst_start, length)`` of
    framework parameter ``dst_name``; the other dimension is taken whole.

    Both tensors are seen in the algebra's 2-D form (``[rows, everything else]``; 1-D tensors as they are), so an HF
    Conv3d weight fills vLLM's linear patch embedding (vLLM flattens it the same way).
    """

    src_name: str
    dst_name: str
    dim: int
    src_start: int
    dst_start: int
    length: int

    def src_view(self, src: torch.Tensor) -> torch.Tensor:
        return as_2d(src).narrow(self.dim, self.src_start, self.length)

    def dst_view(self, dst: torch.Tensor) -> torch.Tensor:
        return as_2d(dst).narrow(self.dim, self.dst_start, self.length)

    def covers_whole_source(self, src_shape: Sequence[int]) -> bool:
        return self.src_start == 0 and self.length == shape_2d(src_shape)[self.dim]


def shape_2d(shape: Sequence[int]) -> tuple[int, ...]:
    """The algebra's view of a tensor shape: 1-D stays 1-D, more dimensions become ``(rows, the rest)``."""
    shape = tuple(int(s) for s in shape)
    if len(shape) <= 2:
        return shape
    rest = 1
    for s in shape[1:]:
        rest *= s
    return (shape[0], rest)


def as_2d(t: torch.Tensor) -> torch.Tensor:
    # flatten(1) of a contiguous tensor is a view, so writes through a destination view reach the parameter
    return t if t.dim() <= 2 else t.flatten(1)


@dataclass(frozen=True)
class SourceRows:
    """Where one source's rows sit: rows ``[v_start, v_start + rows)`` of V are rows ``[hf_start, hf_start + rows)``
    of HF tensor ``hf_name``, which is cut into ``parts`` equal parts (more than one for a fused HF tensor)."""

    hf_name: str
    v_start: int
    rows: int
    hf_start: int = 0
    parts: int = 1


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids: (position of the run, first id, length)."""
    if len(ids) == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(ids)]])
    return [(int(a), int(ids[a]), int(b - a)) for a, b in zip(starts, ends)]


def slice_pairs(rows: np.ndarray, cols: np.ndarray, sources: Sequence[SourceRows], num_cols: int,
                dst_name: str) -> list[SlicePair]:
    """The index maps ``(rows, cols)`` of one parameter as narrow copies from its HF sources.

    Padding rows (ids past the real rows of V) get no copy: they keep what the framework initialised. Raises
    :class:`LayoutError` for a map that is no single-dimension narrow (rows and columns both split, or a column
    split over several sources): no vLLM or Megatron layout of the supported models is one.
    """
    ends = np.array([s.v_start + s.rows for s in sources])
    whole_cols = len(cols) == num_cols and bool((cols == np.arange(num_cols)).all())
    pairs: list[SlicePair] = []
    for pos, first, length in _runs(rows):
        # a run may cross from one source into the next (or into padding): cut it at source ends
        while length > 0:
            i = int(np.searchsorted(ends, first, side="right"))
            if i == len(sources):
                break  # padding rows
            src = sources[i]
            n = min(length, src.v_start + src.rows - first)
            pairs.append(SlicePair(src.hf_name, dst_name, 0, src.hf_start + first - src.v_start, pos, n))
            pos, first, length = pos + n, first + n, length - n
    if whole_cols:
        return pairs
    col_runs = _runs(cols)
    whole_rows = len(pairs) == 1 and pairs[0].dst_start == 0 and pairs[0].length == len(rows)
    if len(col_runs) != 1 or not whole_rows:
        raise LayoutError(f"{dst_name}: not a narrow of one source along one dimension (rows and columns both "
                          "selected, or a column split over several sources)")
    (_, first_col, n_cols), row_pair = col_runs[0], pairs[0]
    src = next(s for s in sources if s.hf_name == row_pair.src_name)
    if src.parts != 1 or row_pair.src_start != 0 or row_pair.length != src.rows:
        raise LayoutError(f"{dst_name}: a column split needs every row of one whole HF tensor")
    return [SlicePair(row_pair.src_name, dst_name, 1, first_col, 0, n_cols)]

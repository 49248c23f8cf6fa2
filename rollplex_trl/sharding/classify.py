"""Byte-level classification of one rollout tensor against the training shards it is made of.

A rollout tensor R (one vLLM parameter on one rank) is first cut into *runs*: maximal pieces that are contiguous
both in R and in one training shard's storage (row-major, as the framework allocates it). Then:

- **aligned**: R is byte-identical to one contiguous virtual range built from training storage. A single run is
  aligned as it is; several runs are aligned when they can be stitched at page granularity ``page`` without a gap:
  every run but the first and last is a whole number of pages, and each training shard can be placed (with padding
  in its arena) so that every run starts (and ends) on a page boundary. Unchanged vLLM kernels can use it.
- **view**: not aligned, but R is one ``torch.as_strided`` view of the training shards it needs, each mapped whole at
  a page-aligned address (e.g. a row-parallel shard made of two training shards is ``[out, 2, in/t]``, and a
  ``[gate; up]`` shard over two Megatron ranks is ``[2, 2, ffn/t, hidden]``). ``plain`` views (2-D, unit last
  stride, e.g. a narrow of a replicated tensor) suit unchanged kernels; others need a blocked GEMM
  (:func:`rollplex_trl.sharding.views.view_linear`).
- **copy**: everything else; rebuilt into the rollout rank's reusable buffer after every optimizer step.

Everything is computed on index maps (numpy), never on weights, so a 72B model is planned in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ALIGNED, VIEW, COPY = "aligned", "view", "copy"
CLASSES = (ALIGNED, VIEW, COPY)
MAX_VIEW_DIMS = 8


@dataclass
class Runs:
    """Maximal contiguous pieces of one rollout tensor, in elements, sorted by ``dst``.

    ``holder`` indexes the shard list the runs were cut against (-1: rows no training shard has, i.e. vocabulary
    padding that only the rollout side adds; they are zero-filled).
    """

    dst: np.ndarray
    holder: np.ndarray
    src: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.dst)


@dataclass(frozen=True)
class ViewSpec:
    """R = as_strided(S, sizes, strides, offset) over the stitched storage S of ``blocks`` (elements).

    Block ``i`` starts at element ``bases[i]`` of S. ``row_dims``: how many leading dims index R's rows (output
    features); the rest index its columns.
    """

    blocks: tuple[int, ...]
    bases: tuple[int, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    row_dims: int
    plain: bool


@dataclass
class Classified:
    """The class of one rollout tensor and everything needed to build it."""

    cls: str
    runs: Runs
    view: ViewSpec | None = None
    # holder -> required residue (bytes mod page) of that shard's start in its training arena
    constraints: dict[int, int] = field(default_factory=dict)
    reason: str = ""
    _copy_ops: list | None = None

    def copy_ops(self) -> list[tuple[int, int, int, int, int, int, int]]:
        """Runs compressed into strided copies ``(holder, count, length, dst, dst_step, src, src_step)``."""
        if self._copy_ops is None:
            self._copy_ops = compress_runs(self.runs)
        return self._copy_ops


def decompose(target: tuple[np.ndarray, np.ndarray], shards: list[tuple[np.ndarray, np.ndarray]]) -> Runs:
    """Cut a tensor ``V[rows][:, cols]`` into runs against training shards, earlier shards preferred.

    Element (a, b) comes from the first shard (in list order) that holds both its row id and its column id.
    """
    t_rows, t_cols = target
    width = len(t_cols)
    n_ids = 1 + max([int(t_rows.max())] + [int(r.max()) for r, _ in shards])
    n_cols = 1 + max([int(t_cols.max())] + [int(c.max()) for _, c in shards])
    rowpos = np.full((len(shards), n_ids), -1, dtype=np.int64)
    colpos = np.full((len(shards), n_cols), -1, dtype=np.int64)
    for h, (rows, cols) in enumerate(shards):
        rowpos[h, rows] = np.arange(len(rows))
        colpos[h, cols] = np.arange(len(cols))
    held = rowpos[:, t_rows] >= 0  # (holders, target rows)
    if len(shards) < 63:  # rows that the same shards hold, grouped through one integer code per row
        codes, which = np.unique((held.T.astype(np.int64) << np.arange(len(shards))).sum(axis=1),
                                 return_inverse=True)
        patterns = (codes[:, None] >> np.arange(len(shards))) & 1
    else:
        patterns, which = np.unique(held.T, axis=0, return_inverse=True)
    pieces = []
    for p, pattern in enumerate(patterns):
        a = np.nonzero(which.reshape(-1) == p)[0]
        owner = np.full(width, -1, dtype=np.int64)
        srccol = np.zeros(width, dtype=np.int64)
        for h in np.nonzero(pattern)[0]:
            pos = colpos[h, t_cols]
            free = (owner < 0) & (pos >= 0)
            owner[free], srccol[free] = h, pos[free]
        # Column segments: same owner and consecutive source columns.
        cut = np.ones(width, dtype=bool)
        cut[1:] = (owner[1:] != owner[:-1]) | (srccol[1:] != srccol[:-1] + 1)
        starts = np.nonzero(cut)[0]
        lengths = np.diff(np.append(starts, width))
        for b0, seg_len in zip(starts, lengths):
            h = owner[b0]
            dst = a * width + b0
            if h < 0:
                src = np.zeros_like(a)
            else:
                src = rowpos[h, t_rows[a]] * len(shards[h][1]) + srccol[b0]
            pieces.append((dst, np.full(len(a), h), src, np.full(len(a), seg_len)))
    dst, holder, src, length = (np.concatenate(x) for x in zip(*pieces))
    order = np.argsort(dst, kind="stable")
    return merge_runs(Runs(dst[order], holder[order], src[order], length[order]))


def merge_runs(runs: Runs) -> Runs:
    """Join neighbouring runs that are contiguous in both the tensor and the same shard."""
    d, h, s, n = runs.dst, runs.holder, runs.src, runs.length
    if len(d) <= 1:
        return runs
    joined = (h[1:] == h[:-1]) & (d[1:] == d[:-1] + n[:-1]) & ((h[1:] < 0) | (s[1:] == s[:-1] + n[:-1]))
    starts = np.nonzero(np.concatenate([[True], ~joined]))[0]
    return Runs(d[starts], h[starts], s[starts], np.add.reduceat(n, starts))


def stitch_constraints(runs: Runs, page: int, esize: int) -> dict[int, int] | None:
    """Residues (shard start mod page, bytes) that make the runs stitchable without a gap, or None."""
    if (runs.holder < 0).any():
        return None
    if len(runs) == 1:
        return {}
    length, src = runs.length * esize, runs.src * esize
    if (length[1:-1] % page).any():
        return None
    # The first run must end on a page boundary, every later run must start on one.
    required = np.concatenate([[-(src[0] + length[0])], -src[1:]]) % page
    need: dict[int, int] = {}
    for h, r in zip(runs.holder.tolist(), required.tolist()):
        if need.setdefault(h, r) != r:
            return None
    return need


def affine_factor(f: np.ndarray) -> list[tuple[int, int]] | None:
    """Write f[i] - f[0] as sum_d idx_d * stride_d over a mixed radix of i; return [(size, stride)] outer first."""
    n = len(f)
    if n <= 1:
        return []
    diffs = np.diff(f)
    step = diffs[0]
    bad = np.nonzero(diffs != step)[0]
    inner = n if len(bad) == 0 else int(bad[0]) + 1
    if n % inner:
        return None
    blocks = f.reshape(-1, inner)
    if not (blocks - blocks[:, :1] == np.arange(inner) * step).all():
        return None
    outer = affine_factor(blocks[:, 0])
    return None if outer is None else outer + [(inner, int(step))]


def find_view(runs: Runs, shape2d: tuple[int, int], shard_sizes: list[int], page: int,
              esize: int) -> tuple[ViewSpec, dict[int, int]] | None:
    """R as one as_strided view of the whole shards it touches, stitched in order of first use, or None."""
    if (runs.holder < 0).any():
        return None
    rows, width = shape2d
    if width == 1:  # a 1-D tensor: one row of `rows` elements
        rows, width = 1, rows
    _, first = np.unique(runs.holder, return_index=True)
    blocks = runs.holder[np.sort(first)].tolist()
    padded = [-(-shard_sizes[b] * esize // page) * page // esize for b in blocks]
    bases = np.cumsum([0] + padded[:-1]) if len(blocks) > 1 else np.zeros(1, dtype=np.int64)
    base_of = dict(zip(blocks, bases.tolist()))
    voff = np.array([base_of[h] for h in runs.holder.tolist()]) + runs.src
    # Cut runs at row boundaries.
    d, n = runs.dst, runs.length
    first_row, last_row = d // width, (d + n - 1) // width
    count = last_row - first_row + 1
    idx = np.repeat(np.arange(len(d)), count)
    row = first_row[idx] + (np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count))
    start = np.maximum(d[idx], row * width)
    end = np.minimum(d[idx] + n[idx], (row + 1) * width)
    piece_off = voff[idx] + (start - d[idx])
    segs = len(start) // rows
    if segs * rows != len(start) or segs == 0 or not (row.reshape(rows, segs) == np.arange(rows)[:, None]).all():
        return None
    col0 = (start - row * width).reshape(rows, segs)
    seg_len = (end - start).reshape(rows, segs)
    seg = int(seg_len[0, 0])
    if not ((seg_len == seg).all() and (col0 == np.arange(segs) * seg).all()):
        return None
    off = piece_off.reshape(rows, segs)
    row_dims = affine_factor(off[:, 0])
    seg_dims = affine_factor(off[0] - off[0, 0])
    if row_dims is None or seg_dims is None or not (off == off[:, :1] + (off[0] - off[0, 0])).all():
        return None
    dims = row_dims + seg_dims + [(seg, 1)]
    if len(dims) > MAX_VIEW_DIMS:
        return None
    n_row = len(row_dims) if shape2d[1] != 1 else 0
    plain = len(dims) == (2 if shape2d[1] != 1 else 1) and len(blocks) == 1
    spec = ViewSpec(tuple(blocks), tuple(int(b) for b in bases), tuple(s for s, _ in dims),
                    tuple(st for _, st in dims), int(off[0, 0]), n_row, plain)
    return spec, ({b: 0 for b in blocks} if len(blocks) > 1 else {})


def classify(runs: Runs, shape2d: tuple[int, int], shard_sizes: list[int], page: int, esize: int,
             allow_aligned: bool = True, allow_view: bool = True) -> Classified:
    """Aligned if stitchable, else view if one strided view exists, else copy (see the module docstring)."""
    if (runs.holder < 0).any():
        return Classified(COPY, runs, reason="rows the training side does not have (vocabulary padding)")
    if allow_aligned:
        need = stitch_constraints(runs, page, esize)
        if need is not None:
            return Classified(ALIGNED, runs, constraints=need)
    if allow_view:
        found = find_view(runs, shape2d, shard_sizes, page, esize)
        if found is not None:
            return Classified(VIEW, runs, view=found[0], constraints=found[1])
    why = f"{len(runs)} runs" + ("" if allow_aligned else ", page residues conflict")
    return Classified(COPY, runs, reason=why)


def compress_runs(runs: Runs) -> list[tuple[int, int, int, int, int, int, int]]:
    """Group runs from one shard with equal length and constant steps into strided copies."""
    order = np.lexsort((runs.dst, runs.holder))
    h, d, s, n = (x[order].tolist() for x in (runs.holder, runs.dst, runs.src, runs.length))
    ops: list[list[int]] = []
    for hi, di, si, ni in zip(h, d, s, n):
        if hi < 0:
            continue  # padding rows: the buffer starts zero-filled and they are never written
        if ops:
            op = ops[-1]
            if op[0] == hi and op[2] == ni:
                if op[1] == 1:
                    op[4], op[6] = di - op[3], si - op[5]
                    op[1] = 2
                    continue
                if di == op[3] + op[1] * op[4] and si == op[5] + op[1] * op[6]:
                    op[1] += 1
                    continue
        ops.append([hi, 1, ni, di, 0, si, 0])
    return [tuple(op) for op in ops]

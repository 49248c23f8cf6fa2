"""The sharing plan: computed from layouts, inspected (printed / JSON), then executed by ``executor``.

World: ``W = max(t, r)`` devices (or ``world_size``), device ``d`` hosts training rank ``d % t`` (training replica
``d // t``) and one rollout slot (rollout replica, rank j) chosen by :mod:`placement`. For every vLLM parameter of
every rollout slot the plan holds its class (:mod:`classify`), how to build it (a direct view of the local training
tensor, pages stitched into a virtual range, or a region of the reusable rebuild buffer) and the strided copies that
refresh its copied bytes after every optimizer step. For every training rank it holds the arena layout: where each
Megatron parameter lives in that rank's one shared allocation, padded so that stitched blocks start on pages.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from rollplex_trl.sharding.classify import ALIGNED, CLASSES, COPY, VIEW, Classified, classify, decompose
from rollplex_trl.sharding.layouts import Concat, ShardSpec, VocabPadding, shard_index
from rollplex_trl.sharding.models import ModelSpec, ParamGroup
from rollplex_trl.sharding.placement import place

TENSOR_ALIGN = 256  # bytes; arena and buffer start every tensor at least this aligned (like Megatron's 64 elements)
PAPER = {"by_params": {ALIGNED: 0.600, VIEW: 0.328, COPY: 0.072}, "buffer_gib": 1.1, "full_copy_gib": 7.6}

COUNTING_RULE = (
    "Each element of each vLLM parameter shard on each rollout rank is counted in that shard's class. aligned: the "
    "shard is byte-identical to one contiguous virtual range built from training storage (pieces of training "
    "shards stitched at the mapping granularity; every piece but the first and last a whole number of pages); "
    "view: else one torch.as_strided view of the whole training shards it needs, each mapped at a page-aligned "
    "address; copy: everything else (rebuilt into the buffer after each optimizer step). by_params: fraction of the "
    "HF model's parameters, each counted once (an element held by several rollout ranks of a replica weighs "
    "1/copies in each; vocabulary padding is not a parameter). Bytes include padding and count every copy.")


@dataclass(frozen=True)
class ShardingOptions:
    """What the plan assumes about both frameworks and the hardware."""

    train_tp: int
    rollout_tp: int
    world_size: int | None = None  # default max(t, r)
    megatron_vision: str = "replicated"  # "replicated" (Megatron-Bridge, ROLL) or "sharded" (verl / mbridge)
    vllm_vision: str = "sharded"  # "sharded" (mm_encoder_tp_mode="weights") or "replicated" ("data")
    megatron_vocab_multiple: int = 0  # Megatron-LM make_vocab_size_divisible_by (x t); 0 = no padding (Bridge)
    vllm_vocab_multiple: int = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE
    page_size: int = 2 << 20  # CUDA VMM granularity; 4096 for CPU shared memory
    element_size: int = 2  # bf16
    remote: str = "copy"  # bytes held by another device: "copy" them each sync, or "map" them (peer mapping)
    placement: str = "optimal"  # or "naive": replica-major
    bucket_bytes: int = 256 << 20
    # whether the rollout engine takes the `view` class (a strided view over several stitched shards, e.g. a
    # row-parallel weight as (rows, t, cols / t)); False for a consumer that needs plain tensors (the transformers
    # model): those tensors are copied instead
    rollout_views: bool = True

    @property
    def world(self) -> int:
        return self.world_size or max(self.train_tp, self.rollout_tp)

    def check(self) -> None:
        w, t, r = self.world, self.train_tp, self.rollout_tp
        if t < 1 or r < 1 or w % t or w % r:
            raise ValueError(f"world size {w} must be a multiple of train TP {t} and rollout TP {r}")
        for name, value, allowed in (("megatron_vision", self.megatron_vision, ("replicated", "sharded")),
                                     ("vllm_vision", self.vllm_vision, ("sharded", "replicated")),
                                     ("remote", self.remote, ("copy", "map")),
                                     ("placement", self.placement, ("optimal", "naive"))):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: expected one of {allowed}")
        if self.page_size % TENSOR_ALIGN or self.page_size % self.element_size:
            raise ValueError(f"page size {self.page_size} must be a multiple of {TENSOR_ALIGN} bytes")


@dataclass(frozen=True)
class MappedSpan:
    """``nbytes`` at ``va`` of a tensor's virtual range, mapped from a training arena or the rollout buffer."""

    va: int
    nbytes: int
    source: str  # "train" or "buffer"
    train_rank: int  # for "train": which training rank's arena (on the device chosen by the executor)
    offset: int  # page-aligned byte offset in that arena or in the buffer


@dataclass(frozen=True)
class CopyOp:
    """``count`` strided copies of ``nbytes`` from training rank ``train_rank``'s arena into the buffer."""

    train_rank: int
    count: int
    nbytes: int
    dst: int
    dst_step: int
    src: int
    src_step: int

    @property
    def total(self) -> int:
        return self.count * self.nbytes


@dataclass
class RolloutTensor:
    """One vLLM parameter on one device, and how the executor builds it."""

    name: str
    group: int
    shape: tuple[int, ...]
    nbytes: int
    params: float  # HF parameters it accounts for (see COUNTING_RULE)
    result: Classified
    holders: list[tuple[int, int]]  # holder index -> (training spec, training rank)
    mode: str = ""  # "direct" (a view of the local training tensor), "mapped" (stitched pages), "buffer"
    offset: int = 0  # direct: byte offset in the local arena; mapped: tensor start in its range; buffer: offset
    va_size: int = 0
    spans: list[MappedSpan] = field(default_factory=list)  # mapped: what its range is stitched from
    copies: list[CopyOp] = field(default_factory=list)
    local_bytes: int = 0
    remote_bytes: int = 0

    @property
    def cls(self) -> str:
        return self.result.cls

    @property
    def copied_bytes(self) -> int:
        return sum(c.total for c in self.copies)


@dataclass
class DevicePlan:
    device: int
    train_rank: int
    replica: int
    rollout_rank: int
    tensors: list[RolloutTensor] = field(default_factory=list)
    buffer_size: int = 0


@dataclass
class ArenaEntry:
    group: int
    spec: int
    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]


@dataclass
class ShardingPlan:
    """Everything computed; ``summary()`` / ``to_json()`` / ``format()`` inspect it, ``executor`` runs it."""

    model: ModelSpec
    options: ShardingOptions
    devices: list[DevicePlan]
    arenas: list[list[ArenaEntry]]  # per training rank
    arena_sizes: list[int]
    arena_padding: list[int]  # bytes beyond the 256-byte tensor alignment, spent to page-align stitched shards
    local_fraction: dict[str, float]  # bytes of rollout shards held by the co-located training rank, by placement

    def arena_entry(self, train_rank: int, group: int, spec: int) -> ArenaEntry:
        return self._index[train_rank][(group, spec)]

    def __post_init__(self):
        self._index = [{(e.group, e.spec): e for e in arena} for arena in self.arenas]

    def summary(self) -> dict:
        from rollplex_trl.sharding.report import summarize

        return summarize(self)

    def to_json(self) -> dict:
        return self.summary()

    def format(self) -> str:
        from rollplex_trl.sharding.report import format_plan

        return format_plan(self)

    def __str__(self) -> str:
        return self.format()


# ------------------------------------------------------------------------------------------------ layouts per side
@functools.lru_cache(maxsize=65536)
def train_specs(group: ParamGroup, opts: ShardingOptions) -> list[tuple[ShardSpec, str]]:
    """The training parameters of a group, with their names. A replicated vision tower keeps HF tensors as they are."""
    if group.kind.tower == "vision" and opts.megatron_vision == "replicated":
        by_name: dict[str, list[int]] = {}
        for i, name in enumerate(group.hf_names):
            by_name.setdefault(name, []).append(i)
        return [(ShardSpec(name.removeprefix("model."), tuple(idx), Concat(), None), name.removeprefix("model."))
                for name, idx in by_name.items()]
    return [(spec, group.megatron_name(spec)) for spec in group.kind.megatron]


@functools.lru_cache(maxsize=65536)
def rollout_specs(group: ParamGroup, opts: ShardingOptions) -> list[tuple[ShardSpec, str]]:
    specs = group.kind.vllm
    if group.kind.tower == "vision" and opts.vllm_vision == "replicated":
        specs = tuple(replace(s, split=None) for s in specs)
    return [(spec, group.vllm_name(spec)) for spec in specs]


class LayoutMaps:
    """Memoized index maps per (group signature, side, spec, rank)."""

    def __init__(self, opts: ShardingOptions):
        self.opts = opts
        self.cache: dict = {}
        mult = opts.megatron_vocab_multiple
        self.padding = {"train": VocabPadding(mult, True) if mult else None,
                        "rollout": VocabPadding(opts.vllm_vocab_multiple, False)}

    def get(self, group: ParamGroup, side: str, spec_index: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
        specs = train_specs(group, self.opts) if side == "train" else rollout_specs(group, self.opts)
        spec, name = specs[spec_index]
        tp = self.opts.train_tp if side == "train" else self.opts.rollout_tp
        if spec.split is None:
            rank = 0  # replicated: every rank holds the full tensor
        key = (group.signature, side, spec_index, rank)
        if key not in self.cache:
            self.cache[key] = shard_index(spec, [group.source_rows[i] for i in spec.sources],
                                          [group.units[i] for i in spec.sources], group.num_cols, tp, rank,
                                          self.padding[side], f"{'Megatron' if side == 'train' else 'vLLM'} {name}")
        return self.cache[key]


def _shape(group: ParamGroup, rows: np.ndarray, cols: np.ndarray) -> tuple[int, ...]:
    return (len(rows),) if group.one_dim else (len(rows), len(cols))


def _param_weights(maps: list[tuple[np.ndarray, np.ndarray]], n_real: int) -> list[float]:
    """HF elements each rank accounts for; an element held by c ranks weighs 1/c in each."""
    rows_same = all(np.array_equal(maps[0][0], m[0]) for m in maps)
    if rows_same:
        cols = np.concatenate([m[1] for m in maps])
        count = np.bincount(cols)
        real_rows = int((maps[0][0] < n_real).sum())
        return [real_rows * float((1.0 / count[c]).sum()) for _, c in maps]
    rows = np.concatenate([m[0] for m in maps])
    rows = rows[rows < n_real]
    count = np.bincount(rows, minlength=n_real)
    return [len(c) * float((1.0 / count[r[r < n_real]]).sum()) for r, c in maps]


# --------------------------------------------------------------------------------------------------- the planner
def plan_sharding(model: ModelSpec, options: ShardingOptions) -> ShardingPlan:
    """Classify every rollout tensor, place rollout ranks, lay out training arenas and rollout buffers."""
    options.check()
    opts, t, r, world = options, options.train_tp, options.rollout_tp, options.world
    esize, page = opts.element_size, opts.page_size
    maps = LayoutMaps(opts)
    reps: dict[tuple, int] = {}
    for gi, g in enumerate(model.groups):
        reps.setdefault(g.signature, gi)

    # 1. Placement: bytes of rollout rank j's shards that training rank k holds (maps are separable, so count
    #    rows and columns held; different training specs of a group never hold the same element).
    counts: dict[tuple, int] = {}
    for g in model.groups:
        counts[g.signature] = counts.get(g.signature, 0) + 1
    local, rollout_bytes = np.zeros((r, t)), np.zeros(r)
    for sig, gi in reps.items():
        g = model.groups[gi]
        for si in range(len(rollout_specs(g, opts))):
            for j in range(r):
                rr, rc = maps.get(g, "rollout", si, j)
                rollout_bytes[j] += len(rr) * len(rc) * esize * counts[sig]
                for k in range(t):
                    for mi in range(len(train_specs(g, opts))):
                        tr, tc = maps.get(g, "train", mi, k)
                        held = np.isin(rr, tr).sum() * np.isin(rc, tc).sum()
                        local[j, k] += held * esize * counts[sig]
    slots = place(local, world, t, r, optimal=opts.placement == "optimal")
    frac = {name: float(sum(local[j, d % t] for d, (_, j) in enumerate(s)) / sum(rollout_bytes[j] for _, j in s))
            for name, s in (("chosen", slots), ("naive", place(local, world, t, r, optimal=False)))}

    # 2. Classify one representative group per signature for every (rollout rank, local training rank).
    results: dict[tuple, tuple[Classified, list, list[int]]] = {}

    def classify_key(key, allow_aligned=True, allow_view=True):
        sig, si, j, k_local = key
        g = model.groups[reps[sig]]
        n_train = len(train_specs(g, opts))
        holders = sorted(((m, k) for m in range(n_train) for k in range(t)), key=lambda h: (h[1] != k_local, h))
        # A replicated training tensor is held by every rank: keep only the local copy.
        holders = [h for h in holders if train_specs(g, opts)[h[0]][0].split is not None or h[1] == k_local]
        shard_maps = [maps.get(g, "train", m, k) for m, k in holders]
        target = maps.get(g, "rollout", si, j)
        runs = decompose(target, shard_maps)
        shape2d = (len(target[0]), 1 if g.one_dim else len(target[1]))
        sizes = [len(a) * len(b) for a, b in shard_maps]
        return (classify(runs, shape2d, sizes, page, esize, allow_aligned, allow_view and opts.rollout_views),
                holders, sizes)

    keys = set()
    for d, (_, j) in enumerate(slots):
        for sig, gi in reps.items():
            for si in range(len(rollout_specs(model.groups[gi], opts))):
                keys.add((sig, si, j, d % t))
    for key in sorted(keys, key=str):
        results[key] = classify_key(key)

    # 3. Page residues of training shards: one per (signature, holder), chosen by the bytes that want it; tensors
    #    that disagree are downgraded (aligned -> view -> copy), so this ends after at most two rounds per tensor.
    while True:
        votes: dict[tuple, dict[int, int]] = {}
        for key, (res, holders, _) in results.items():
            nbytes = int(res.runs.length.sum()) * esize
            for h, rv in res.constraints.items():
                slot = votes.setdefault((key[0], holders[h]), {})
                slot[rv] = slot.get(rv, 0) + nbytes
        residue = {k: max(v.items(), key=lambda kv: (kv[1], -kv[0]))[0] for k, v in votes.items()}
        changed = False
        for key, (res, holders, _) in list(results.items()):
            if any(residue[(key[0], holders[h])] != rv for h, rv in res.constraints.items()):
                results[key] = classify_key(key, allow_aligned=False, allow_view=res.cls != VIEW)
                changed = True
        if not changed:
            break

    # 4. Training arenas: every training rank lays out its shards in model order.
    arenas, arena_sizes, arena_padding = [], [], []
    for k in range(t):
        cursor, padding, entries = 0, 0, []
        for gi, g in enumerate(model.groups):
            for mi, (_spec, name) in enumerate(train_specs(g, opts)):
                rows, cols = maps.get(g, "train", mi, k)
                nbytes = len(rows) * len(cols) * esize
                aligned = -(-cursor // TENSOR_ALIGN) * TENSOR_ALIGN
                want = residue.get((g.signature, (mi, k)))
                offset = aligned if want is None else aligned + (want - aligned) % page
                padding += offset - aligned
                entries.append(ArenaEntry(gi, mi, name, offset, nbytes, _shape(g, rows, cols)))
                cursor = offset + nbytes
        arenas.append(entries)
        arena_sizes.append(-(-cursor // page) * page)
        arena_padding.append(padding)
    plan = ShardingPlan(model, opts, [], arenas, arena_sizes, arena_padding, frac)

    # 5. Rollout tensors per device, with their mapping pieces and copies.
    weights: dict[tuple, list[float]] = {}
    for d, (rep, j) in enumerate(slots):
        dev = DevicePlan(d, d % t, rep, j)
        buffer = [0]
        for gi, g in enumerate(model.groups):
            for si, (_spec, name) in enumerate(rollout_specs(g, opts)):
                wkey = (g.signature, si)
                if wkey not in weights:
                    n_real = sum(rows for rows, _ in g.shapes)
                    weights[wkey] = _param_weights([maps.get(g, "rollout", si, jj) for jj in range(r)], n_real)
                res, holders, _ = results[(g.signature, si, j, d % t)]
                rows, cols = maps.get(g, "rollout", si, j)
                shape = _shape(g, rows, cols)
                tensor = RolloutTensor(name, gi, shape, math.prod(shape) * esize, weights[wkey][j], res, holders)
                _build(plan, dev, tensor, buffer)
                dev.tensors.append(tensor)
        dev.buffer_size = -(-buffer[0] // page) * page
        plan.devices.append(dev)
    return plan


def _alloc(buffer: list[int], nbytes: int, residue: int | None, page: int) -> int:
    """Next buffer offset (256-byte aligned, or congruent to ``residue`` mod page)."""
    start = -(-buffer[0] // TENSOR_ALIGN) * TENSOR_ALIGN
    if residue is not None:
        start += (residue - start) % page
    buffer[0] = start + nbytes
    return start


def _build(plan: ShardingPlan, dev: DevicePlan, tensor: RolloutTensor, buffer: list[int]) -> None:
    """Decide how one rollout tensor is built on one device: direct view, stitched pages, or the buffer."""
    opts, page, esize = plan.options, plan.options.page_size, plan.options.element_size
    res, runs = tensor.result, tensor.result.runs

    def arena(h: int) -> ArenaEntry:
        m, k = tensor.holders[h]
        return plan.arena_entry(k, tensor.group, m)

    def is_local(h: int) -> bool:
        return tensor.holders[h][1] == dev.train_rank

    run_bytes = runs.length * esize
    held = runs.holder >= 0
    local_holder = np.array([k == dev.train_rank for _, k in tensor.holders] + [False])  # index -1: padding
    tensor.local_bytes = int(run_bytes[local_holder[runs.holder]].sum())
    tensor.remote_bytes = int(run_bytes[held].sum()) - tensor.local_bytes
    copy_remote = opts.remote == "copy"

    if res.cls == COPY or (copy_remote and tensor.local_bytes == 0 and len(runs) == 1):
        tensor.mode = "buffer"
        tensor.offset = _alloc(buffer, tensor.nbytes, None, page)
        for h, count, n, dst, dstep, src, sstep in res.copy_ops():
            e = arena(h)
            tensor.copies.append(CopyOp(tensor.holders[h][1], count, n * esize, tensor.offset + dst * esize,
                                        dstep * esize, e.offset + src * esize, sstep * esize))
        return

    if res.cls == ALIGNED and len(runs) == 1 and is_local(int(runs.holder[0])):
        tensor.mode, tensor.offset = "direct", arena(int(runs.holder[0])).offset + int(runs.src[0]) * esize
        return
    if res.cls == VIEW and len(res.view.blocks) == 1 and is_local(res.view.blocks[0]):
        tensor.mode, tensor.offset = "direct", arena(res.view.blocks[0]).offset
        return

    # Stitched virtual range: pieces of training arenas (local or peer-mapped) or of the buffer (copied).
    tensor.mode = "mapped"
    if res.cls == ALIGNED:
        blocks = [(int(h), int(s) * esize, int(d) * esize, int(n) * esize)
                  for h, s, d, n in zip(runs.holder, runs.src, runs.dst, runs.length)]
        first = arena(blocks[0][0]).offset + blocks[0][1]
        start = first % page
    else:
        view = res.view
        blocks = [(b, 0, base * esize, arena(b).nbytes) for b, base in zip(view.blocks, view.bases)]
        start = arena(view.blocks[0]).offset % page if len(view.blocks) == 1 else 0
    tensor.offset = start
    end = 0
    for h, src, dst, n in blocks:
        file_off = arena(h).offset + src
        va = start + dst
        lead = file_off % page
        if (va - lead) % page:
            raise AssertionError(f"{tensor.name}: piece at {va} not congruent to its source")  # a planner bug
        length = -(-(lead + n) // page) * page
        if is_local(h) or not copy_remote:
            tensor.spans.append(MappedSpan(va - lead, length, "train", tensor.holders[h][1], file_off - lead))
        else:
            b = _alloc(buffer, n, lead, page)
            tensor.spans.append(MappedSpan(va - lead, length, "buffer", -1, b - lead))
            tensor.copies.append(CopyOp(tensor.holders[h][1], 1, n, b, 0, file_off, 0))
        end = max(end, va - lead + length)
    tensor.va_size = end


def kinds_table(plan: ShardingPlan) -> dict[str, dict]:
    """Per parameter kind: HF parameters and the class(es) it gets on the devices."""
    out: dict[str, dict] = {}
    for dev in plan.devices:
        for tensor in dev.tensors:
            g = plan.model.groups[tensor.group]
            row = out.setdefault(g.kind.key, {"params": 0.0, **{c: 0.0 for c in CLASSES}})
            row[tensor.cls] += tensor.params
    n_rep = plan.options.world // plan.options.rollout_tp
    for row in out.values():
        row["params"] = sum(row[c] for c in CLASSES) / n_rep
        for c in CLASSES:
            row[c] /= n_rep
    return out

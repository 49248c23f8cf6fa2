"""Exact, bucketed weight sync from the trainer's tensors into an in-process vLLM model.

One sync walks a plan built once (per vLLM parameter, the `SlicePair`s that `rollplex_trl.sharding`'s layout table
gives this rank, see `vllm_targets.py`) and, per bucket of parameters, issues a single `torch._foreach_copy_` from
views of the trainer's tensors into views of vLLM's parameters: no per-tensor Python loader calls (TRL calls vLLM's
`load_weights` once per tensor), dtype conversion inside the copy, LoRA deltas added with one `torch._foreach_add_`
per bucket.

Three kinds of destination:
- direct: vLLM's parameter is what its kernel reads (CUDA, and on CPU the norms, biases and embeddings);
- staged: vLLM repacked the layer after loading (its CPU backend turns linear weights into oneDNN handles and
  empties `layer.weight`): the bucket is copied into a flat staging buffer in vLLM's unpacked layout and the
  layer's own post-load processing runs again on it, exactly as after a checkpoint load;
- aliased: the trainer's tensor *is* a view of vLLM's parameter (TP = 1, same dtype and device, not repacked): the
  optimizer step already updated vLLM and the sync copies nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rollplex_trl.notices import notice
from rollplex_trl.rollout.layout import (
    Target,
    alias_blockers,
    check_tiling,
    group_into_buckets,
    install_alias,
    is_alias_of,
)
from rollplex_trl.rollout.sources import TrainerTensor
from rollplex_trl.sharding.layouts import SlicePair, shape_2d
from rollplex_trl.torch_compat import foreach_add_, foreach_copy_

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


@dataclass
class SyncStats:
    seconds: float = 0.0
    bytes_copied: int = 0  # bytes written into vLLM (staged bytes count once)
    bytes_aliased: int = 0  # bytes vLLM reads from the trainer's own storage (no copy)
    tensors_copied: int = 0
    buckets: int = 0
    layers_repacked: int = 0
    repack_s: float = 0.0  # part of `seconds` spent in vLLM's post-load processing (CPU backend)
    full: bool = True

    def metrics(self) -> dict[str, float]:
        return {"rollplex/weight_sync_s": self.seconds, "rollplex/weight_sync_bytes": float(self.bytes_copied),
                "rollplex/weight_sync_aliased_bytes": float(self.bytes_aliased)}


class TargetModel(Protocol):
    """The vLLM side, as the sync needs it (implemented for a real vLLM model in `vllm_targets.py`)."""

    targets: dict[str, Target]  # vLLM parameter name -> unpacked layout and pieces

    def live(self, name: str) -> torch.Tensor | None:
        """The tensor to write `name` into directly, or None when it must be staged (repacked and emptied)."""

    def reprocess(self, module_name: str, staged_weight: torch.Tensor | None) -> None:
        """Run the layer's post-load processing again (repack) from `staged_weight` or its kept weight."""


@dataclass
class _Plan:
    targets: list[Target]
    pieces_by_source: dict[str, list[SlicePair]] = field(default_factory=dict)
    aliased: dict[str, SlicePair] = field(default_factory=dict)  # HF name -> its piece, when aliased
    alias_refused: dict[str, str] = field(default_factory=dict)


class WeightSync:
    """Copies (or aliases) the trainer's tensors into vLLM. Build once per engine; `sync()` after each step."""

    def __init__(self, model: TargetModel, sources: Callable[[], Iterable[TrainerTensor]], *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, alias: bool = True, alias_blocker: str | None = None):
        self.model = model
        self._sources = sources
        self.bucket_bytes = bucket_bytes
        self._alias_wanted = alias
        self._alias_blocker = alias_blocker  # a reason that turns aliasing off globally (e.g. tensor parallelism)
        self._plan: _Plan | None = None
        self._staging_buffers: dict[torch.dtype, torch.Tensor] = {}
        self.last: SyncStats | None = None

    # ------------------------------------------------------------------------------------------------------------

    def _build_plan(self, sources: dict[str, TrainerTensor]) -> _Plan:
        targets = list(self.model.targets.values())
        plan = _Plan(targets=targets)
        shapes = {name: tuple(s.tensor.shape) for name, s in sources.items()}
        for t in targets:
            missing = [p.src_name for p in t.pieces if p.src_name not in sources]
            if missing:
                raise KeyError(f"vLLM parameter {t.name} needs trainer tensors {missing}, which the trainer's model "
                               "does not have under those names")
            check_tiling(t, shapes)
            for p in t.pieces:
                plan.pieces_by_source.setdefault(p.src_name, []).append(p)
        unused = sorted(set(sources) - set(plan.pieces_by_source))
        if unused:
            # e.g. rotary buffers or a vision tower vLLM does not load: vLLM would ignore them too
            logger.info("weight sync: %d trainer tensors have no vLLM parameter (first: %s)", len(unused), unused[:3])
        self._decide_aliases(plan, sources)
        return plan

    def _decide_aliases(self, plan: _Plan, sources: dict[str, TrainerTensor]) -> None:
        if not self._alias_wanted:
            return
        target_of = {t.name: t for t in plan.targets}
        reasons_seen: dict[str, int] = {}
        for name, pieces in plan.pieces_by_source.items():
            src = sources[name]
            piece = pieces[0]
            target = target_of[piece.dst_name]
            reasons = [self._alias_blocker] if self._alias_blocker else []
            if src.delta is not None:
                reasons.append("vLLM needs base + LoRA delta, not the trainer's base tensor")
            if not isinstance(src.param, torch.nn.Parameter):
                reasons.append("the trainer tensor is not a parameter")
            reasons += alias_blockers(target, src.tensor, None if target.repacked else self.model.live(target.name),
                                      piece, shared_source=len(pieces) > 1)
            if reasons:
                plan.alias_refused[name] = reasons[0]
                reasons_seen[reasons[0]] = reasons_seen.get(reasons[0], 0) + 1
            else:
                plan.aliased[name] = piece
        for name, piece in plan.aliased.items():
            install_alias(sources[name].param, self.model.live(piece.dst_name), piece)
        if reasons_seen:
            summary = "; ".join(f"{n} tensors: {r}" for r, n in sorted(reasons_seen.items(), key=lambda x: -x[1]))
            notice(f"weight sync: {len(plan.aliased)} tensors aliased (zero-copy), {len(plan.alias_refused)} copied "
                   f"at each sync ({summary})")
        else:
            notice(f"weight sync: all {len(plan.aliased)} tensors aliased (zero-copy)")

    @property
    def aliased_names(self) -> list[str]:
        return sorted(self._plan.aliased) if self._plan else []

    @property
    def alias_refusals(self) -> dict[str, str]:
        return dict(self._plan.alias_refused) if self._plan else {}

    # ------------------------------------------------------------------------------------------------------------

    def sync(self, full: bool = True) -> SyncStats:
        """Bring vLLM's weights to the trainer's current values.

        `full=False` skips tensors that cannot have changed since the last sync (frozen, no LoRA delta); use it only
        when vLLM's weights were kept since then (not discarded by sleep level 2).
        """
        start = time.perf_counter()
        sources = {s.name: s for s in self._sources()}
        if self._plan is None:
            self._plan = self._build_plan(sources)
            full = True
        plan = self._plan
        stats = SyncStats(full=full)
        for name, piece in list(plan.aliased.items()):
            if is_alias_of(sources[name].tensor, self.model.live(piece.dst_name), piece):
                stats.bytes_aliased += sources[name].tensor.nbytes
            else:  # the trainer moved the tensor (e.g. `.to()`); copy it this time and restore the alias
                install_alias(sources[name].param, self.model.live(piece.dst_name), piece)
                stats.bytes_copied += sources[name].tensor.nbytes
        todo = [t for t in plan.targets if self._needs_copy(t, sources, plan, full)]
        by_name = {t.name: t for t in todo}
        deltas: dict[str, torch.Tensor] = {}
        for bucket in group_into_buckets(((t.name, t.nbytes) for t in todo), self.bucket_bytes):
            self._copy_bucket([by_name[n] for n in bucket], sources, deltas, plan, stats)
            stats.buckets += 1
        stats.seconds = time.perf_counter() - start
        self.last = stats
        return stats

    @staticmethod
    def _needs_copy(t: Target, sources: dict[str, TrainerTensor], plan: _Plan, full: bool) -> bool:
        pieces = [p for p in t.pieces if p.src_name not in plan.aliased]
        if not pieces:
            return False
        return full or any(sources[p.src_name].trainable for p in pieces)

    def _copy_bucket(self, targets: list[Target], sources: dict[str, TrainerTensor], deltas: dict[str, torch.Tensor],
                     plan: _Plan, stats: SyncStats) -> None:
        staged_numel: dict[torch.dtype, int] = {}
        for t in targets:
            if t.repacked and not t.keeps_weight:
                staged_numel[t.dtype] = staged_numel.get(t.dtype, 0) + t.nbytes // t.dtype.itemsize
        flat = {dt: self._staging(dt, n) for dt, n in staged_numel.items()}
        offsets = dict.fromkeys(flat, 0)
        dst_of: dict[str, torch.Tensor] = {}
        for t in targets:
            if t.repacked and not t.keeps_weight:
                n = t.nbytes // t.dtype.itemsize
                view = flat[t.dtype][offsets[t.dtype]:offsets[t.dtype] + n].view(t.shape)
                offsets[t.dtype] += n
                # a partial tiling (vocab padding rows) must not leave garbage where vLLM had zeros
                if sum(p.length for p in t.pieces) != shape_2d(t.shape)[t.pieces[0].dim]:
                    view.zero_()
                dst_of[t.name] = view
            else:
                dst_of[t.name] = self.model.live(t.name)
        dsts, srcs, delta_dsts, delta_srcs = [], [], [], []
        for t in targets:
            for p in t.pieces:
                if p.src_name in plan.aliased:
                    continue
                s = sources[p.src_name]
                dsts.append(p.dst_view(dst_of[t.name]))
                srcs.append(p.src_view(s.tensor))
                stats.bytes_copied += dsts[-1].numel() * dsts[-1].element_size()
                if s.delta is not None:
                    if p.src_name not in deltas:
                        deltas[p.src_name] = s.delta()
                    delta_dsts.append(dsts[-1])
                    delta_srcs.append(p.src_view(deltas[p.src_name]).to(dsts[-1].dtype))
        with torch.no_grad():
            if dsts:
                foreach_copy_(dsts, srcs)
                stats.tensors_copied += len(dsts)
            if delta_dsts:
                foreach_add_(delta_dsts, delta_srcs)
            start = time.perf_counter()
            for t in targets:
                if t.repacked and t.attr == "weight":
                    self.model.reprocess(t.module_name, None if t.keeps_weight else dst_of[t.name])
                    stats.layers_repacked += 1
            stats.repack_s += time.perf_counter() - start

    def _staging(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """One flat staging buffer per dtype, kept across buckets and syncs: vLLM's repack copies out of it, so it
        can be reused at once, and a warm buffer saves the page faults of a fresh allocation at every sync."""
        buf = self._staging_buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self._staging_device())
            self._staging_buffers[dtype] = buf
        return buf[:numel]

    def _staging_device(self) -> torch.device:
        for t in self.model.targets.values():
            live = None if t.repacked and not t.keeps_weight else self.model.live(t.name)
            if live is not None:
                return live.device
        return torch.device("cpu")

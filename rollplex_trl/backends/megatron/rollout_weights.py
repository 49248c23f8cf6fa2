"""The rollout engine's weights, live on the Megatron backend: views of the training shards where the layouts allow,
rebuilt from them after every optimizer step where they do not.

The rollout engine here is the transformers model the trainer generates with (TRL's `generate` path). Every one of
its LLM and vision tensors is classified once, from the layout algebra (`rollplex_trl.sharding`), never by names:

- **aliased**: the HF tensor is a contiguous run of whole rows of one training parameter held by this process (all
  columns, rows in order). Its `.data` becomes a view of that parameter's storage, so the optimizer's in-place update
  is already the rollout's weight: nothing moves at sync time. At t = 1 this is every tensor but q/k/v (Megatron
  interleaves them per KV group); the replicated vision tower always is.
- **copied**: everything else (q/k/v, and at t > 1 every tensor split over ranks: those bytes live in other
  processes). After each optimizer step the group's shards are all-gathered over the TP group and the HF tensor is
  rebuilt from them by inverting the index maps (`V[rows, cols] = shard`).

This is the binding of `rollplex_weight_mapping="off"` (and of "auto" where the mapping cannot run): at t > 1 the
split tensors take the copy path. `mapped_weights.py` maps peer ranks' shards too (shared memory), so there only the
tensors whose layouts are incompatible are copied.

The stale-weights guard: `version` counts optimizer steps; `sync()` brings the rollout to it and `check_fresh()`
refuses to generate from an older version.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rollplex_trl.sharding.models import ModelSpec, ParamGroup
from rollplex_trl.sharding.plan import LayoutMaps, ShardingOptions, train_specs


@contextlib.contextmanager
def autocast_caches_weights(model: nn.Module) -> Iterator[None]:
    """Within the block (the decode steps), autocast casts each of the rollout model's weights once per autocast
    region instead of at every step (rollout/weight_casts.py: torch keeps the casts of weights that require grad
    only). The Megatron backend's rollout model is frozen (the Megatron policy trains; the rollout reads its
    storage), and nothing differentiates through it: TRL generates under no_grad, the window's prefix jobs run the
    Megatron models, and the vision tower they train is the policy's own copy. So its weights are marked whether
    prefix jobs run concurrently or not (on the `hf` backend the trainer must check for the actor's job).

    Split-K Linears (split_k.py) read their weight through views, whose casts autocast never keeps: they keep their
    own casts for the block (the weights cannot change during a rollout: the on-policy barrier syncs them before it
    and the optimizer steps after it), dropped at its end."""
    from rollplex_trl.backends.megatron.split_k import SplitKLinear
    from rollplex_trl.rollout.weight_casts import frozen_weight_casts_kept

    split_k = [m for m in model.modules() if isinstance(m, SplitKLinear)]
    for m in split_k:
        m._rollout_casts = {}
    try:
        with frozen_weight_casts_kept(model):
            yield
    finally:
        for m in split_k:
            m._rollout_casts = None


class StaleRolloutWeights(RuntimeError):
    """The rollout engine was about to generate from weights older than the last optimizer step."""


class WeightVersionGuard:
    """The stale-weights guard both rollout bindings share: `version` counts optimizer steps, `synced_version` is
    what the rollout model holds, and `_bound` records (name, parameter, data pointer) of every tensor whose data
    must stay where the binding put it."""

    def __init__(self) -> None:
        self.version = 0  # optimizer steps taken
        self.synced_version = 0  # the version the rollout model holds
        self._bound: list[tuple[str, nn.Parameter, int]] = []

    def optimizer_stepped(self) -> None:
        self.version += 1

    def check_aliases(self) -> None:
        """A bound tensor whose data was replaced (e.g. by a loader assigning new tensors) no longer follows the
        training parameters: fail with its name instead of generating from stale weights."""
        moved = [name for name, param, ptr in self._bound if param.data_ptr() != ptr]
        if moved:
            raise StaleRolloutWeights(f"rollout tensors {moved[:3]} (of {len(moved)}) no longer share storage with "
                                      "the training parameters they are bound to; rebind the rollout model after "
                                      "replacing its tensors")

    def check_fresh(self) -> None:
        self.check_aliases()
        if self.synced_version != self.version:
            raise StaleRolloutWeights(
                f"the rollout model holds the weights of optimizer step {self.synced_version}, but {self.version} "
                "steps were taken: generating now would be off-policy. Call sync() after each optimizer step.")


@dataclass
class SyncStats:
    """What one sync moved (bytes) and how long it took; the aliased bytes moved nothing."""

    bytes_copied: int = 0
    bytes_aliased: int = 0
    seconds: float = 0.0


@dataclass
class _Target:
    """One HF tensor of the rollout model and where its rows live in its group's stacked sources V."""

    name: str
    param: nn.Parameter
    v_rows: np.ndarray  # the V row ids of this tensor's rows, in order (a fused tensor: its parts in order)


@dataclass
class _CopyGroup:
    group: ParamGroup
    targets: list[_Target]
    shards: list[tuple[nn.Parameter, int]] = field(default_factory=list)  # (training parameter, spec index)


def _hf_targets(group: ParamGroup, hf_params: dict[str, nn.Parameter]) -> list[_Target]:
    by_name: dict[str, list[np.ndarray]] = {}
    for source, name, rows in zip(group.kind.sources, group.hf_names, group.source_rows):
        by_name.setdefault(name, []).append((source.part[0], rows))
    targets = []
    for name, parts in by_name.items():
        if name not in hf_params:
            raise KeyError(f"rollout model has no tensor {name!r} (from the sharding spec of {group.kind.key})")
        ordered = np.concatenate([rows for _, rows in sorted(parts, key=lambda p: p[0])])
        targets.append(_Target(name, hf_params[name], ordered))
    return targets


def _contiguous_run(shard_rows: np.ndarray, wanted: np.ndarray) -> int | None:
    """Start index a0 with shard_rows[a0 : a0 + len(wanted)] == wanted, or None."""
    hits = np.flatnonzero(shard_rows == wanted[0])
    for a0 in hits:
        if a0 + len(wanted) <= len(shard_rows) and np.array_equal(shard_rows[a0:a0 + len(wanted)], wanted):
            return int(a0)
    return None


class LiveRolloutWeights(WeightVersionGuard):
    """Binds a transformers rollout model to the Megatron training parameters (see the module docstring).

    ``train_param(group, spec_index, name)`` returns this rank's training parameter for a train spec of a group
    (the Megatron GPTModel's, or the replicated vision tower's).
    """

    def __init__(self, spec: ModelSpec, options: ShardingOptions, rollout_model: nn.Module, train_param,
                 tp_rank: int, tp_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.spec, self.options, self.tp_rank, self.tp_group = spec, options, tp_rank, tp_group
        self.maps = LayoutMaps(options)
        hf_params = dict(rollout_model.named_parameters())
        self.aliased: list[tuple[str, int]] = []  # (name, bytes)
        self.copy_groups: list[_CopyGroup] = []
        for group in spec.groups:
            shards = []
            for si, (_spec, name) in enumerate(train_specs(group, options)):
                shards.append((train_param(group, si, name), si))
            left = []
            for target in _hf_targets(group, hf_params):
                if not self._try_alias(group, target, shards):
                    left.append(target)
            if left:
                self.copy_groups.append(_CopyGroup(group, left, shards))
        self.last = SyncStats(bytes_aliased=self.bytes_aliased)

    # ---- classification -----------------------------------------------------------------------------------------

    def _try_alias(self, group: ParamGroup, target: _Target, shards: list[tuple[nn.Parameter, int]]) -> bool:
        for param, si in shards:
            rows, cols = self.maps.get(group, "train", si, self.tp_rank)
            if len(cols) != group.num_cols or not np.array_equal(cols, np.arange(group.num_cols)):
                continue
            a0 = _contiguous_run(rows, target.v_rows)
            if a0 is None or param.dtype != target.param.dtype:
                continue
            flat = param.data.view(len(rows), -1) if param.dim() > 1 else param.data.view(len(rows), 1)
            view = flat[a0:a0 + len(target.v_rows)].view(target.param.shape)
            with torch.no_grad():
                if not torch.equal(view, target.param.data):
                    raise RuntimeError(f"rollout tensor {target.name} differs from the training parameter it would "
                                       "alias: the two models were not built from the same weights")
            target.param.data = view
            self.aliased.append((target.name, target.param.numel() * target.param.element_size()))
            self._bound.append((target.name, target.param, view.data_ptr()))
            return True
        return False

    @property
    def bytes_aliased(self) -> int:
        return sum(b for _, b in self.aliased)

    @property
    def bytes_copied_per_sync(self) -> int:
        return sum(t.param.numel() * t.param.element_size() for g in self.copy_groups for t in g.targets)

    def table(self) -> str:
        """The live classification, one line per class (logged once at start-up)."""
        copied = [t.name for g in self.copy_groups for t in g.targets]
        return (f"rollout weights: {len(self.aliased)} tensors aliased ({self.bytes_aliased / 2**20:.1f} MiB, "
                f"0 bytes per sync), {len(copied)} rebuilt after each optimizer step "
                f"({self.bytes_copied_per_sync / 2**20:.1f} MiB per sync; e.g. {copied[:2]})")

    # ---- the on-policy barrier ----------------------------------------------------------------------------------

    @torch.no_grad()
    def sync(self) -> SyncStats | None:
        """Rebuild the copied tensors from the training shards if an optimizer step happened since the last sync;
        returns what it did, or None when the rollout was already current."""
        if self.synced_version == self.version:
            return None
        start = time.perf_counter()
        copied = 0
        for cg in self.copy_groups:
            v = self._gather_sources(cg)
            for target in cg.targets:
                rows = torch.as_tensor(target.v_rows)
                target.param.data.copy_(v.index_select(0, rows).view(target.param.shape))
                copied += target.param.numel() * target.param.element_size()
        self.synced_version = self.version
        self.last = SyncStats(copied, self.bytes_aliased, time.perf_counter() - start)
        return self.last

    def _gather_sources(self, cg: _CopyGroup) -> torch.Tensor:
        """V (the group's stacked HF sources, (rows, cols)) rebuilt from every TP rank's shards."""
        group = cg.group
        total_rows = sum(r for r, _ in group.shapes)
        first = cg.shards[0][0]
        v = torch.empty(total_rows, group.num_cols, dtype=first.dtype, device=first.device)
        tp = self.options.train_tp
        for param, si in cg.shards:
            local = param.data.reshape(-1, 1) if param.dim() == 1 else param.data.reshape(param.shape[0], -1)
            split = train_specs(group, self.options)[si][0].split
            pieces = [local]
            if split is not None and tp > 1:
                pieces = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(pieces, local.contiguous(), group=self.tp_group)
            for rank, piece in enumerate(pieces):
                rows, cols = self.maps.get(group, "train", si, rank)
                real = rows < total_rows  # vocabulary padding rows have no HF row
                index_rows = torch.as_tensor(rows[real])
                index_cols = torch.as_tensor(cols)
                v[index_rows[:, None], index_cols[None, :]] = piece[torch.as_tensor(np.flatnonzero(real))]
        return v

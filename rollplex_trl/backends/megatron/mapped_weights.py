"""The rollout model's weights mapped onto the training shards' own memory, across the TP group's processes.

`rollout_weights.LiveRolloutWeights` aliases only what this process holds (whole rows of one local parameter) and
rebuilds the rest from an all-gather after each optimizer step: at t > 1 every split tensor is copied. This binding
executes the sharding plan (`sharding/plan.py`, `sharding/executor.py`) for the transformers rollout model instead:

1. Each TP rank's training parameters (its GPTModel shards and the replicated vision tower) move into one
   shared-memory file laid out by the plan (`TrainingStorage.adopt`: `param.data` becomes a view of it, so AdamW's
   in-place update writes there).
2. Each rank maps its TP peers' files and builds the plan's rollout tensors (vLLM's layout at rollout TP 1: fused
   `qkv_proj` and `gate_up_proj`) from them: pages of local and peer shards stitched into one virtual address range
   where the bytes line up on pages (classes `aligned` and `view`), a region of a rebuild buffer where they do not
   (class `copy`: e.g. a row-parallel weight, whose rows interleave both ranks' columns).
3. Each transformers tensor becomes a row slice of its rollout tensor (q/k/v of `qkv_proj`, gate/up of
   `gate_up_proj`): its data *is* the training bytes, a peer's included, so an optimizer step is the rollout's
   weights with nothing moved. After each step only the copy class is refreshed, by strided copies out of the
   mapped files (no collective carries them).

Ordering across processes (the on-policy barrier): a peer's optimizer step writes into tensors this rank's rollout
reads. `sync()` waits for the whole TP group (every rank's step done) before any rank copies or generates; a
rank's next step comes after its peers finished generating, because the step's backward needs collectives that a
peer enters only after its generation.

The files are unlinked as soon as every rank has mapped them: the mappings keep the memory alive, and a crashed
run leaves nothing in /dev/shm. The mappings are never unmapped while the process lives (the optimizer, the
transformers model and checkpoints may hold tensors that are views of them); the kernel frees them at exit.

Tested on CPU (shared-memory files + mmap). On CUDA the same binding runs on the executor's driver-VMM memory
(`memory/cuda_vmm.py`: allocations exported by descriptor, peers' granules mapped into one range, 2 MiB pages):
written, NEVER RUN (no GPU was lent), so `rollplex_weight_mapping="auto"` does not select it there; `"on"` does.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rollplex_trl.backends.megatron.rollout_weights import (
    SyncStats,
    WeightVersionGuard,
    _contiguous_run,
    _hf_targets,
)
from rollplex_trl.backends.megatron.split_k import to_split_k
from rollplex_trl.sharding.classify import VIEW
from rollplex_trl.sharding.models import ModelSpec, ParamGroup
from rollplex_trl.sharding.plan import LayoutMaps, ShardingOptions, ShardingPlan, plan_sharding, rollout_specs

SHM_ROOT = "/dev/shm"
SHM_HEADROOM = 1.25  # free space /dev/shm must have beyond what the mapping allocates (tmpfs SIGBUSes when full)


@dataclass(frozen=True)
class _Binding:
    """One transformers tensor as rows [start, start + rows) of one rollout tensor of the plan."""

    hf_name: str
    rollout: str  # the plan's rollout tensor (vLLM name)
    start: int
    rows: int
    mode: str  # the rollout tensor's build mode: "direct", "mapped" or "buffer" (copied after every step)
    split_k: bool = False  # a strided (out, t, in / t) view over t shards, read by a split-K Linear (split_k.py)


def mapping_options(options: ShardingOptions, element_size: int, page_size: int,
                    views: bool = False) -> ShardingOptions:
    """The plan this binding executes: the backend's training layout, one full rollout replica per TP rank (r = 1,
    the transformers model), CPU pages, peer shards mapped rather than copied, no vocabulary padding and an
    unsharded vision tower on the rollout side (the transformers model's). ``views``: the plan's `view` class
    (a row-parallel weight split over ranks as one strided view, read by `split_k.SplitKLinear`); without it
    those weights are copied, since a plain transformers Linear needs a plain (out, in) weight."""
    return dataclasses.replace(options, rollout_tp=1, world_size=options.train_tp, page_size=page_size,
                               element_size=element_size, remote="map", vllm_vision="replicated",
                               vllm_vocab_multiple=1, rollout_views=views)


def plan_bindings(spec: ModelSpec, plan: ShardingPlan, device: int,
                  hf_params: dict[str, nn.Parameter]) -> list[_Binding]:
    """Where every transformers tensor lies in the plan's rollout tensors of one device; raises if one does not lie
    in a single rollout tensor as a run of whole rows (then this binding cannot serve that model)."""
    maps = LayoutMaps(plan.options)
    tensors = iter(plan.devices[device].tensors)
    out = []
    for group in spec.groups:
        placed: dict[str, _Binding] = {}
        targets = _hf_targets(group, hf_params)
        for si, (_spec, name) in enumerate(rollout_specs(group, plan.options)):
            tensor = next(tensors)
            if tensor.name != name:
                raise AssertionError(f"plan order: expected {name}, found {tensor.name}")  # a planner bug
            rows = maps.get(group, "rollout", si, 0)[0]
            for target in targets:
                if target.name in placed:
                    continue
                start = _contiguous_run(rows, target.v_rows)
                if start is not None:
                    placed[target.name] = _Binding(target.name, name, start, len(target.v_rows), tensor.mode,
                                                   tensor.cls == VIEW)
        missing = [t.name for t in targets if t.name not in placed]
        if missing:
            raise ValueError(f"{missing[0]} is not a run of whole rows of one rollout tensor of {group.kind.key}")
        out.extend(placed[t.name] for t in targets)
    return out


def _memory(device: torch.device):
    """The executor's memory backend for the rollout model's device."""
    from rollplex_trl.sharding.executor import CpuMemory, CudaMemory

    if device.type == "cuda":
        return CudaMemory(device.index if device.index is not None else torch.cuda.current_device())
    return CpuMemory(SHM_ROOT)


@dataclass
class MappingPlan:
    """What one process maps: the plan, where each transformers tensor lies in it, the memory backend."""

    plan: ShardingPlan
    bindings: list[_Binding]
    memory: Any  # sharding.executor.CpuMemory or CudaMemory
    dtype: torch.dtype
    split_k_note: str | None = None  # split-K views were asked for but cannot serve this model: why


def _split_k_problem(plan: ShardingPlan, bindings: list[_Binding], device: int, rollout_model: nn.Module) -> str | None:
    """Why the plan's `view` tensors cannot be read by split-K Linears of ``rollout_model`` (None: they can)."""
    layouts = {t.name: t for t in plan.devices[device].tensors}
    for b in bindings:
        if not b.split_k:
            continue
        view = layouts[b.rollout].result.view
        module = rollout_model.get_submodule(b.hf_name.rpartition(".")[0])
        if not b.hf_name.endswith(".weight") or type(module) is not nn.Linear:
            return f"{b.hf_name} is a `view` tensor but not the weight of a plain nn.Linear"
        if (b.start, b.rows) != (0, module.out_features) or view.row_dims != 1 or len(view.sizes) != 3:
            return f"{b.hf_name}'s view {tuple(view.sizes)} is not (out, t, in / t) of one rollout tensor"
    return None


def plan_mapping(*, spec: ModelSpec, options: ShardingOptions, rollout_model: nn.Module,
                 train_params: list[nn.Parameter], tp_rank: int, cuda_allowed: bool = False,
                 row_parallel_views: bool = False) -> MappingPlan | str:
    """This process's mapping of its rollout weights onto the training shards, or why there is none (a string).
    Not a collective: the caller agrees on the answer over the TP group (`agree`). What this binding cannot serve
    is a reason, not a raise: a model whose layouts the plan cannot build or bind (`ValueError`, the layout
    algebra's `LayoutError` included) and, on CUDA, a driver that cannot give the mapped memory (`RuntimeError`,
    `OSError`, e.g. `cuda_vmm.VmmUnavailable`). Anything else is a bug (a planner `AssertionError`, an
    `AttributeError`, a `TypeError`, ...) and propagates: "mapping off" must not hide it. `cuda_allowed`: take
    the never-run CUDA path. `row_parallel_views`: read the row-parallel weights in place through split-K Linears
    (the plan's `view` class) where the model allows, else copy them (`MappingPlan.split_k_note` says why)."""
    device = next(rollout_model.parameters()).device
    if device.type == "cuda" and not cuda_allowed:
        return ("the rollout model is on CUDA, where this mapping has never run (rollplex_weight_mapping='on' "
                "takes the driver-VMM path)")
    if device.type not in ("cpu", "cuda"):
        return f"the rollout model is on {device}"
    if device.type == "cpu" and not os.path.isdir(SHM_ROOT):
        return f"{SHM_ROOT} does not exist"
    dtypes = {p.dtype for p in train_params} | {p.dtype for p in rollout_model.parameters()}
    if len(dtypes) != 1:
        return f"training and rollout parameters have several dtypes {sorted(map(str, dtypes))}"
    dtype = dtypes.pop()
    note = None
    try:
        memory = _memory(device)
    except (RuntimeError, OSError) as err:  # the CUDA driver's memory API unavailable or failing (VmmUnavailable)
        return f"the {device.type} memory for the mapping is unavailable: {type(err).__name__}: {err}"
    try:
        esize = torch.empty(0, dtype=dtype).element_size()
        hf_params = dict(rollout_model.named_parameters())
        if row_parallel_views:
            plan = plan_sharding(spec, mapping_options(options, esize, memory.page, views=True))
            bindings = plan_bindings(spec, plan, tp_rank, hf_params)
            note = _split_k_problem(plan, bindings, tp_rank, rollout_model)
        if not row_parallel_views or note is not None:
            plan = plan_sharding(spec, mapping_options(options, esize, memory.page))
            bindings = plan_bindings(spec, plan, tp_rank, hf_params)
    except ValueError as err:  # a layout the plan cannot build or bind (LayoutError is one); bugs propagate
        return f"the plan cannot bind the rollout model: {type(err).__name__}: {err}"
    if device.type == "cpu":  # tmpfs: writing past its size is a SIGBUS, so check the room first
        need = plan.arena_sizes[tp_rank] + plan.devices[tp_rank].buffer_size
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        stat = os.statvfs(SHM_ROOT)
        free = stat.f_bavail * stat.f_frsize
        if need * local_world * SHM_HEADROOM > free:
            return (f"{SHM_ROOT} has {free / 2**20:.0f} MiB free, the mapping needs {need / 2**20:.0f} MiB per "
                    f"process x {local_world} processes (raise the shared-memory size, e.g. docker run --shm-size)")
    return MappingPlan(plan, bindings, memory, dtype, note)


def agree(reason: str | None, tp_group: dist.ProcessGroup | None, tp_size: int) -> str | None:
    """One answer for the whole TP group (every rank must take the same path: the mapping runs barriers): the first
    rank's reason not to map, or the peers not sharing this host (their files could not be mapped)."""
    if tp_size == 1:
        return reason
    answers: list = [None] * tp_size
    dist.all_gather_object(answers, (socket.gethostname(), reason), group=tp_group)
    if len({host for host, _ in answers}) > 1:
        return "the TP group spans several hosts (peer shards can only be mapped on one host)"
    return next((r for _, r in answers if r is not None), None)


class MappedRolloutWeights(WeightVersionGuard):
    """Binds a transformers rollout model to the Megatron training parameters through shared memory (see the module
    docstring). Same interface as `LiveRolloutWeights`: `version`, `sync()`, `check_fresh()`, `table()`.

    ``train_param(group, spec_index, name)`` returns this rank's training parameter for a train spec of a group.
    Call on every TP rank of the group together (barriers), with the `MappingPlan` of `plan_mapping` once
    `agree` said every rank has one.
    """

    def __init__(self, mapping: MappingPlan, spec: ModelSpec, rollout_model: nn.Module,
                 train_param: Callable[[ParamGroup, int, str], nn.Parameter], tp_rank: int,
                 tp_group: dist.ProcessGroup | None, tp_size: int, dp_rank: int) -> None:
        from rollplex_trl.sharding.executor import RolloutWeights, TrainingStorage

        super().__init__()
        self.tp_rank, self.tp_group, self.tp_size = tp_rank, tp_group, tp_size
        self.plan, self.bindings, memory = mapping.plan, mapping.bindings, mapping.memory
        self.device_plan = self.plan.devices[tp_rank]
        session = self._session(dp_rank)
        self.storage = TrainingStorage(self.plan, tp_rank, memory, session, mapping.dtype)
        self.storage.adopt({e.name: train_param(spec.groups[e.group], e.spec, e.name)
                            for e in self.plan.arenas[tp_rank]})
        self._barrier()  # every rank's arena exists and holds its shards
        self.weights = RolloutWeights(self.plan, tp_rank, memory, session, self.storage)
        self.weights.open_peers()  # the copies read peer files too: open them all before they are unlinked
        self._barrier()  # every rank mapped what it needs
        self.storage.file.unlink()
        self.weights.buffer.unlink()
        self.bind(rollout_model)
        self.last = SyncStats(bytes_aliased=self.bytes_aliased)

    def _session(self, dp_rank: int) -> str:
        """A name for this TP group's files, the same on every rank of the group, new for every binding."""
        box = [f"{os.getpid()}-{uuid.uuid4().hex[:8]}-dp{dp_rank}"]
        if self.tp_size > 1:
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        return box[0]

    def _barrier(self) -> None:
        if self.tp_size > 1:
            dist.barrier(group=self.tp_group)

    @torch.no_grad()
    def bind(self, rollout_model: nn.Module) -> None:
        """Point every transformers tensor at its place in the mapped rollout tensors (again after a loader replaced
        them: the values must be the training shards' already). A collective over the TP group."""
        self._barrier()  # peers' shards are final (e.g. reloaded from a checkpoint)
        self.weights.sync()
        hf_params = dict(rollout_model.named_parameters())
        self._bound = []
        for b in self.bindings:
            param = hf_params[b.hf_name]
            rows = self.weights.tensors[b.rollout][b.start:b.start + b.rows]
            # a split-K weight is compared in the view's (out, t, in / t) shape (its own already, after a bind)
            view = rows if b.split_k else rows.view(param.shape)
            if not torch.equal(view, param.data.reshape(view.shape)):
                raise RuntimeError(f"rollout tensor {b.hf_name} differs from the training shards it would map: the "
                                   "two models were not built from the same weights")
            if b.split_k:
                to_split_k(rollout_model.get_submodule(b.hf_name.rpartition(".")[0]), view)
            else:
                param.data = view
            self._bound.append((b.hf_name, param, view.data_ptr()))
        self._barrier()  # no rank generates before every rank checked its views

    # ---- what the plan says ---------------------------------------------------------------------------------------

    def _bytes(self, copied: bool) -> int:
        sizes = {name: p.numel() * p.element_size() for name, p, _ in self._bound}
        return sum(sizes[b.hf_name] for b in self.bindings if (b.mode == "buffer") == copied)

    @property
    def bytes_aliased(self) -> int:
        """Bytes of transformers tensors that are the training shards' memory (local or a peer's)."""
        return self._bytes(False)

    @property
    def bytes_copied_per_sync(self) -> int:
        """The plan's copy bytes for this device: what every sync moves."""
        return sum(t.copied_bytes for t in self.device_plan.tensors)

    @property
    def bytes_from_peers(self) -> int:
        """Aliased bytes that lie in a TP peer's shards (mapped from its file)."""
        return sum(t.remote_bytes for t in self.device_plan.tensors if t.mode != "buffer")

    def table(self) -> str:
        """The live classification, one line (logged once at start-up)."""
        n_copied = sum(b.mode == "buffer" for b in self.bindings)
        n_split_k = sum(b.split_k for b in self.bindings)
        copied = [b.hf_name for b in self.bindings if b.mode == "buffer"]
        return (f"rollout weights mapped onto the training shards (shared memory, {self.tp_size} processes): "
                f"{len(self.bindings) - n_copied} tensors aliased ({self.bytes_aliased / 2**20:.1f} MiB, of which "
                f"{self.bytes_from_peers / 2**20:.1f} MiB in peers' shards; 0 bytes per sync; {n_split_k} of them "
                f"row-parallel weights read through split-K views), {n_copied} rebuilt after each optimizer step "
                f"({self.bytes_copied_per_sync / 2**20:.2f} MiB per sync; e.g. {copied[:2]})")

    def classes(self) -> dict[str, str]:
        """transformers name -> how its data is held: 'direct', 'mapped' (stitched pages), 'split-k' (stitched
        pages read as an (out, t, in / t) view by a split-K Linear) or 'buffer' (copied)."""
        return {b.hf_name: "split-k" if b.split_k else b.mode for b in self.bindings}

    # ---- the on-policy barrier (the guard: WeightVersionGuard) --------------------------------------------------

    @torch.no_grad()
    def sync(self) -> SyncStats | None:
        """After an optimizer step: wait for every TP rank's step, then refresh the copy class; None when the
        rollout was current already. A collective over the TP group."""
        if self.synced_version == self.version:
            return None
        start = time.perf_counter()
        self._barrier()  # every rank's optimizer step wrote its shards (which this rank's rollout maps)
        stats = self.weights.sync()
        self.weights.wait()
        self.synced_version = self.version
        self.last = SyncStats(int(stats["bytes"]), self.bytes_aliased, time.perf_counter() - start)
        return self.last


def backing_files(tensor: torch.Tensor) -> set[str]:
    """The shared-memory files whose pages hold ``tensor``'s bytes in this process (from /proc/self/maps; for
    tests and debugging). A tensor in private memory gives {''}."""
    from rollplex_trl.sharding import shm

    span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) if tensor.numel() else 0
    nbytes = span * tensor.element_size()
    start = tensor.data_ptr()
    out = set()
    for addr in np.arange(start - start % shm.PAGE, start + max(nbytes, 1), shm.PAGE):
        where = shm.backing_of(int(addr))
        out.add(os.path.basename(where[0]) if where else "")
    return out

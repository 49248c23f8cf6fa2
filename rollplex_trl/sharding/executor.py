"""Executing a plan for real: training storage in shared allocations, rollout tensors as views of it.

Per device (one process each, as in a colocated trainer + rollout engine):

1. ``TrainingStorage`` allocates the training rank's arena (one shared allocation laid out by the plan) and
   ``adopt``s the framework's parameters: their data moves into the arena and ``param.data`` becomes a view of it,
   as Megatron's DDP ``ParamAndGradBuffer`` does with its flat buffer. The optimizer keeps updating them in place.
2. After every rank's storage exists (a barrier), ``RolloutWeights`` builds every vLLM parameter of the device's
   rollout slot: a direct view of the local training tensor, a range of pages stitched from local and peer
   arenas (aligned and view classes), or a region of one reusable rebuild buffer (copy class, and peer bytes when
   ``remote="copy"``).
3. After every optimizer step, ``sync()`` refreshes the buffer: bucketed strided copies (on CUDA, on a side stream;
   ``wait()`` orders the consumer after them). Aliased tensors need nothing: they *are* the training bytes.

Aliased rollout tensors change the moment the optimizer writes: the rollout must not read them during
``optimizer.step()`` (Rollplex's barriers: parameters are read-only from rollout start until every reader is done).

Backends: :class:`CpuMemory` (shared-memory files + ``mmap``) and :class:`CudaMemory` (driver VMM).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from rollplex_trl.sharding.classify import VIEW
from rollplex_trl.sharding.plan import CopyOp, RolloutTensor, ShardingPlan

if TYPE_CHECKING:
    from rollplex_trl.memory.cuda_vmm import CudaFile, CudaRange
    from rollplex_trl.sharding.shm import SharedFile, VirtualRange


class CpuMemory:
    """Shared-memory files in /dev/shm, mapped with mmap at page granularity."""

    def __init__(self, root: str = "/dev/shm"):
        from rollplex_trl.sharding import shm

        self.shm, self.root, self.page = shm, root, shm.PAGE
        self.device = torch.device("cpu")

    def create(self, name: str, size: int) -> SharedFile:
        return self.shm.SharedFile.create(f"{self.root}/{name}", size)

    def open(self, name: str) -> SharedFile:
        return self.shm.SharedFile.open(f"{self.root}/{name}")

    def range(self, nbytes: int) -> VirtualRange:
        return self.shm.VirtualRange(nbytes)


class CudaMemory:
    """CUDA physical allocations shared by descriptor, mapped with the driver's virtual-memory API
    (:mod:`rollplex_trl.memory.cuda_vmm`, the project's one binding of it)."""

    def __init__(self, device: int):
        from rollplex_trl.memory import cuda_vmm

        torch.cuda.set_device(device)
        torch.cuda.init()  # a current primary context for the driver calls
        self.vmm, self.index, self.page = cuda_vmm, device, cuda_vmm.granularity(device, recommended=True)
        self.device = torch.device("cuda", device)

    def create(self, name: str, size: int) -> CudaFile:
        return self.vmm.CudaFile.create(name, size, self.index)

    def open(self, name: str) -> CudaFile:
        return self.vmm.CudaFile.open(name, self.index)

    def range(self, nbytes: int) -> CudaRange:
        return self.vmm.CudaRange(nbytes, self.index)


def _name(session: str, role: str, device: int) -> str:
    return f"rollplex-{session}-{role}-{device}"


def _check_page(plan: ShardingPlan, memory: CpuMemory | CudaMemory) -> None:
    if plan.options.page_size % memory.page:
        raise ValueError(f"plan page size {plan.options.page_size} is not a multiple of the backend's mapping "
                         f"granularity {memory.page}; plan with page_size={memory.page} (or a multiple)")


class TrainingStorage:
    """One training rank's parameters in one shared allocation, laid out as the plan's arena says."""

    def __init__(self, plan: ShardingPlan, device: int, memory: CpuMemory | CudaMemory, session: str,
                 dtype: torch.dtype):
        _check_page(plan, memory)
        if torch.empty(0, dtype=dtype).element_size() != plan.options.element_size:
            raise ValueError(f"dtype {dtype} does not match the plan's element size {plan.options.element_size}")
        self.plan, self.device, self.dtype = plan, device, dtype
        self.rank = device % plan.options.train_tp
        self.file = memory.create(_name(session, "train", device), plan.arena_sizes[self.rank])
        self.raw = self.file.bytes()
        self.entries = {e.name: e for e in plan.arenas[self.rank]}

    def tensor(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        return self.raw[e.offset:e.offset + e.nbytes].view(self.dtype).view(e.shape)

    def adopt(self, params: Mapping[str, torch.nn.Parameter]) -> None:
        """Move parameters (named as in the plan) into the arena; afterwards ``param.data`` is arena memory."""
        missing, extra = set(self.entries) - set(params), set(params) - set(self.entries)
        if missing or extra:
            raise KeyError(f"training rank {self.rank}: parameters not in the plan {sorted(extra)[:3]}, "
                           f"plan entries without a parameter {sorted(missing)[:3]}")
        for name, param in params.items():
            e = self.entries[name]
            if param.numel() * param.element_size() != e.nbytes or param.dtype != self.dtype:
                raise ValueError(f"{name}: {tuple(param.shape)} {param.dtype} does not fit the plan's "
                                 f"{e.shape} ({e.nbytes} bytes of {self.dtype})")
            view = self.raw[e.offset:e.offset + e.nbytes].view(self.dtype).view(param.shape)
            view.copy_(param.data)
            param.data = view

    def close(self) -> None:
        self.raw = None
        self.file.close()


class RolloutWeights:
    """One rollout rank's vLLM parameters: views of training storage, and a reused buffer for the rest."""

    def __init__(self, plan: ShardingPlan, device: int, memory: CpuMemory | CudaMemory, session: str,
                 local: TrainingStorage):
        _check_page(plan, memory)
        self.plan, self.device, self.memory, self.session, self.local = plan, device, memory, session, local
        self.dtype, self.esize = local.dtype, plan.options.element_size
        self.spec = plan.devices[device]
        self.buffer = memory.create(_name(session, "buffer", device), self.spec.buffer_size)
        self._buf = self.buffer.bytes()
        self._peers: dict[int, object] = {}
        self._sources: dict[int, torch.Tensor] = {}
        self._ranges: list = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.layouts: dict[str, RolloutTensor] = {}
        self.ranges: dict[str, object] = {}  # mapped tensors: their stitched range (spans at rng.addr + span.va)
        for t in self.spec.tensors:
            self.tensors[t.name] = self._build(t)
            self.layouts[t.name] = t
        self._buckets = self._bucket([(t, op) for t in self.spec.tensors for op in t.copies])
        self._stream = torch.cuda.Stream(memory.device) if memory.device.type == "cuda" else None
        self._events: list = []

    # -------------------------------------------------------------------------------------------- building
    def _arena(self, train_rank: int):
        """The allocation of training rank ``train_rank`` seen from this device (its own, or a peer's)."""
        if train_rank == self.local.rank:
            return self.local.file
        t = self.plan.options.train_tp
        peer = (self.device // t) * t + train_rank  # the same training replica as this device
        if peer not in self._peers:
            self._peers[peer] = self.memory.open(_name(self.session, "train", peer))
        return self._peers[peer]

    def open_peers(self) -> None:
        """Open every training arena of this device's replica now (else the first ``sync()`` opens the ones only
        its copies read): afterwards their files may be unlinked."""
        for train_rank in range(self.plan.options.train_tp):
            self._arena(train_rank)

    def _typed(self, raw: torch.Tensor, offset: int) -> torch.Tensor:
        return raw[offset:].view(self.dtype)

    def _build(self, t: RolloutTensor) -> torch.Tensor:
        res = t.result
        if t.mode == "buffer":
            return self._buf[t.offset:t.offset + t.nbytes].view(self.dtype).view(t.shape)
        if t.mode == "direct":
            base = self._typed(self.local.raw, t.offset)
        else:
            rng = self.memory.range(t.va_size)
            self._ranges.append(rng)
            self.ranges[t.name] = rng
            for p in t.spans:
                rng.map(p.va, self.buffer if p.source == "buffer" else self._arena(p.train_rank), p.offset,
                        p.nbytes)
            base = self._typed(rng.bytes(), t.offset)
        if res.cls == VIEW:
            v = res.view
            return torch.as_strided(base, v.sizes, v.strides, base.storage_offset() + v.offset)
        numel = t.nbytes // self.esize
        return base[:numel].view(t.shape)

    def logical(self, name: str) -> torch.Tensor:
        """The tensor in vLLM's shape (a copy only for non-plain views; for checks and debugging)."""
        return self.tensors[name].reshape(self.layouts[name].shape)

    # ------------------------------------------------------------------------------------------------ sync
    def _bucket(self, ops: list[tuple[RolloutTensor, CopyOp]]) -> list[list[CopyOp]]:
        buckets, current, size = [], [], 0
        for _, op in ops:
            current.append(op)
            size += op.total
            if size >= self.plan.options.bucket_bytes:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
        return buckets

    def _copy(self, op: CopyOp) -> None:
        if op.train_rank not in self._sources:
            self._sources[op.train_rank] = self._arena(op.train_rank).bytes()
        src = self._sources[op.train_rank]
        shape = (op.count, op.nbytes)
        dst = torch.as_strided(self._buf, shape, (op.dst_step or op.nbytes, 1), op.dst)
        dst.copy_(torch.as_strided(src, shape, (op.src_step or op.nbytes, 1), op.src), non_blocking=True)

    def sync(self) -> dict[str, int]:
        """Refresh every copied byte from training storage (call after each optimizer step).

        On CUDA the copies run on a side stream, one event per bucket; call ``wait()`` before the rollout reads.
        """
        stats = {"bytes": 0, "from_peers": 0, "buckets": len(self._buckets)}
        self._events = []
        for bucket in self._buckets:
            if self._stream is not None:
                self._stream.wait_stream(torch.cuda.current_stream(self.memory.device))
                with torch.cuda.stream(self._stream):
                    for op in bucket:
                        self._copy(op)
                    self._events.append(self._stream.record_event())
            else:
                for op in bucket:
                    self._copy(op)
            for op in bucket:
                stats["bytes"] += op.total
                stats["from_peers"] += op.total if op.train_rank != self.local.rank else 0
        return stats

    def wait(self) -> None:
        """Make the current stream wait for the last ``sync()`` (no-op on CPU, where sync is synchronous)."""
        for event in self._events:
            torch.cuda.current_stream(self.memory.device).wait_event(event)

    def close(self) -> None:
        """Drop every tensor and unmap everything (tensors built here must not be used afterwards)."""
        self.tensors.clear()
        self.ranges.clear()
        self._buf, self._sources = None, {}
        for rng in self._ranges:
            rng.close()
        for peer in self._peers.values():
            peer.close()
        self.buffer.close()
        self._ranges, self._peers = [], {}

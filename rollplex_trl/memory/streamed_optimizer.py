"""A streamed optimizer: per-parameter state lives on the host and visits the device chunk by chunk.

``StreamedOptimizer(params, torch.optim.AdamW, lr=..., weight_decay=..., chunk_bytes=...)`` wraps any torch
optimizer whose state is per parameter (AdamW, Adam, SGD with momentum, Adagrad, ...). Between steps every state
tensor (except the scalar ``step``) sits in ``storage_device`` memory, page-locked when that is the CPU and the
compute device is CUDA. ``step()`` walks the parameters in chunks of at most ``chunk_bytes`` of state:

    copy stream:    H2D(0) H2D(1) .... D2H(0) H2D(2) .... D2H(1) H2D(3) ...
    compute stream:        step(0) ........... step(1) ........... step(2)

Two device slots hold the chunks: chunk i computes in slot i % 2 while the copy stream writes chunk i-1 back and
brings chunk i+1 into the other slot (stream order makes the slot reuse safe; events order the two streams). At
most two chunks of state are on the device at any time. On CPU the same code runs with plain synchronous copies.

Exactness: the wrapped optimizer runs its own ``step`` on each chunk (its ``param_groups`` swapped for the chunk's
subset), with its own kernel: ``fused=True`` runs torch's fused kernel and ``foreach=True`` its foreach kernels on
the chunk's tensors. AdamW-style updates are elementwise per parameter, so the result is bit-identical to one
unchunked ``step`` of the same optimizer and variant (tested on CPU against ``torch.optim.AdamW`` fused, foreach and
for-loop, amsgrad on/off, weight decay, with a grad scaler's ``grad_scale``/``found_inf``, which are handed to each
chunk's step as ``GradScaler`` hands them to a fused optimizer). The CUDA path (fused kernels on the device, the
state streamed from pinned host memory, the fused ``step`` counters left on the device) is written but has never run.

It is a ``torch.optim.Optimizer``: ``param_groups``, ``state``, ``zero_grad``, ``state_dict``/``load_state_dict``
(host tensors go into checkpoints) and LR schedulers work as usual, so it can be handed to a transformers
``Trainer`` through ``optimizers=(StreamedOptimizer(...), scheduler)``.

CPU compute (``host_arena=HostArena()``): "host" and "device" are the same RAM, so between steps the state waits in
the arena (a file outside the process's resident memory, ``storage.py``) and the state entries are placeholders with
the right shape and a zero-byte storage (FSDP-style); ``step`` reads each chunk's bytes straight into a slot and
writes them back, and frees the slots at its end, so the resident state is at most two chunks, during the step only.
``state_dict()`` materialises the state (checkpoints are those of the wrapped optimizer); ``load_state_dict`` parks
it again. Never read a placeholder: its storage is empty.

Not supported: ``capturable=True`` (made for CUDA graphs: the step reads its learning rate and counters from device
tensors that a graph replays, which streaming would have to capture too), optimizers whose state is not per
parameter (LBFGS), and closures that need the state on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rollplex_trl.memory.lifetime import LifetimeClass, Phase, Placement
from rollplex_trl.memory.storage import HostArena, release_free_memory

if TYPE_CHECKING:
    from rollplex_trl.memory.ledger import MemoryLedger
    from rollplex_trl.memory.registry import MemoryObject, MemoryRegistry

# set on a fused optimizer by torch.amp.GradScaler.step around its step (see `_run_inner`)
_AMP_ATTRS = ("grad_scale", "found_inf")
_ALIGN = 256  # bytes; keeps every state view in a slot aligned for vectorised kernels


@dataclass
class ChunkInfo:
    index: int
    param_indices: list[int]  # positions of the chunk's parameters in the flattened param_groups
    state_bytes: int  # bytes of this chunk's state tensors
    resident_bytes: int  # state bytes on the compute device while this chunk computes (plus the next chunk's)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class StreamedOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        chunk_bytes: int = 256 * 2**20,
        storage_device: torch.device | str = "cpu",
        compute_device: torch.device | str | None = None,
        on_chunk: Callable[[ChunkInfo], None] | None = None,
        host_arena: HostArena | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        inner = optimizer_cls(params, **optimizer_kwargs)
        first = inner.param_groups[0]["params"][0]
        device = torch.device(compute_device) if compute_device is not None else first.device
        if any(group.get("capturable") for group in inner.param_groups):
            raise ValueError(f"StreamedOptimizer cannot stream {optimizer_cls.__name__}(capturable=True): a capturable "
                             "step (for CUDA graphs) keeps its counters and learning rate in device tensors; pass "
                             "capturable=False (fused=True and foreach=True stream)")
        # Share the inner optimizer's group dicts and state: LR schedulers edit our param_groups, the inner step
        # reads the same dicts, and state_dict() sees the host-resident state.
        super().__init__(inner.param_groups, inner.defaults)
        inner.param_groups = self.param_groups
        self.state = inner.state
        self.inner = inner
        # GradScaler hands a fused optimizer its scale and inf flag as attributes instead of unscaling first; they
        # are forwarded to the inner step of every chunk (`_run_inner`), so scaled steps match the fused optimizer's.
        self._step_supports_amp_scaling = getattr(inner, "_step_supports_amp_scaling", False)
        self.chunk_bytes = chunk_bytes
        self.storage_device = torch.device(storage_device)
        self.compute_device = device
        self.on_chunk = on_chunk
        if host_arena is not None and (self.compute_device.type != "cpu" or self.storage_device.type != "cpu"):
            raise ValueError("host_arena is for CPU compute; on CUDA the state waits in pinned host memory")
        self.host_arena = host_arena
        # CPU: compute each chunk in place in the arena's mapped pages instead of copying it into a slot and back
        self.map_arena = host_arena is not None
        self._mapped: dict[tuple[int, str], tuple[Any, torch.Tensor]] = {}
        self._to_unmap: list[Any] = []
        # (id(param), state key) -> the placeholder standing in the state while the bytes are in the arena
        self._placeholders: dict[tuple[int, str], torch.Tensor] = {}
        self.last_step_chunks: list[ChunkInfo] = []
        self._slots: list[torch.Tensor] = []
        self._copy_stream: torch.cuda.Stream | None = None

    # --- state placement ------------------------------------------------------------------------------------------

    @property
    def _cuda(self) -> bool:
        return self.compute_device.type == "cuda" and torch.cuda.is_available()

    def _pin(self) -> bool:
        return self._cuda and self.storage_device.type == "cpu"

    @staticmethod
    def _streamed_items(state: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        # 'step' stays where the wrapped optimizer keeps it: a CPU scalar, or with fused=True a scalar on the
        # parameters' device (4 bytes per parameter, read by the fused kernel)
        return [(k, v) for k, v in state.items() if torch.is_tensor(v) and k != "step"]

    def state_bytes(self) -> int:
        """Bytes of streamed state (all parameters), wherever it is."""
        return sum(v.numel() * v.element_size() for s in self.state.values() for _, v in self._streamed_items(s))

    def _to_storage(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.storage_device and (not self._pin() or t.is_pinned()):
            return t
        home = torch.empty(t.shape, dtype=t.dtype, device=self.storage_device, pin_memory=self._pin())
        return home.copy_(t)

    def offload_state(self) -> None:
        """Move every state tensor to ``storage_device`` (after load_state_dict, or state created elsewhere); with a
        host arena, park it there."""
        for p, s in self.state.items():
            for k, v in self._streamed_items(s):
                s[k] = self._park(p, k, v) if self.host_arena is not None else self._to_storage(v)
        if self.host_arena is not None:
            release_free_memory()

    # --- the host arena (CPU) -------------------------------------------------------------------------------------

    def _is_parked(self, p: torch.Tensor, k: str, v: torch.Tensor) -> bool:
        return self._placeholders.get((id(p), k)) is v

    def _park(self, p: torch.Tensor, k: str, v: torch.Tensor) -> torch.Tensor:
        """Write ``v``'s bytes to the arena; returns the placeholder to keep in the state instead."""
        key = (id(p), k)
        if self._placeholders.get(key) is v:
            return v
        v = v.contiguous()
        nbytes = v.numel() * v.element_size()
        self.host_arena.write(key, v.data_ptr(), nbytes)
        holder = self._placeholders.get(key)
        if holder is None or holder.shape != v.shape or holder.dtype != v.dtype:
            holder = torch.empty(v.shape, dtype=v.dtype, device=self.storage_device)
            holder.untyped_storage().resize_(0)
            self._placeholders[key] = holder
        return holder

    def _unparked(self, p: torch.Tensor, k: str, v: torch.Tensor) -> torch.Tensor:
        """A real tensor with a parked entry's bytes (a new allocation; the arena keeps its copy)."""
        if not self._is_parked(p, k, v):
            return v
        out = torch.empty(v.shape, dtype=v.dtype, device=self.storage_device)
        self.host_arena.read((id(p), k), out.data_ptr(), out.numel() * out.element_size())
        return out

    def state_dict(self) -> dict[str, Any]:
        if self.host_arena is None or not self._placeholders:
            return super().state_dict()
        # Optimizer.state_dict packs the per-parameter dicts themselves: hand it materialised copies, then put the
        # placeholders' dicts back (the returned dict keeps the materialised tensors).
        original = dict(self.state)
        try:
            for p, s in original.items():
                self.state[p] = {k: (self._unparked(p, k, v) if torch.is_tensor(v) else v) for k, v in s.items()}
            return super().state_dict()
        finally:
            for p, s in original.items():
                self.state[p] = s

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Optimizer.load_state_dict casts state onto each parameter's device and replaces self.state and
        # self.param_groups; re-share them with the inner optimizer (its __setstate__ also fills group defaults).
        super().load_state_dict(state_dict)
        self.inner.__setstate__({"state": self.state, "param_groups": self.param_groups})
        self._placeholders.clear()  # the loaded state replaces whatever was parked
        self.offload_state()

    # --- chunking -------------------------------------------------------------------------------------------------

    def _estimated_bytes(self, p: torch.Tensor) -> int:
        state = self.state.get(p)
        if state:
            return sum(_aligned(v.numel() * v.element_size()) for _, v in self._streamed_items(state))
        # State not created yet (first step): assume two moments shaped like the parameter, as Adam(W) has.
        return 2 * _aligned(p.numel() * p.element_size())

    def _plan_chunks(self) -> list[list[tuple[int, int, torch.Tensor]]]:
        """Chunks of (group index, flat index, param) for parameters with a gradient, in param_groups order."""
        chunks: list[list[tuple[int, int, torch.Tensor]]] = []
        current: list[tuple[int, int, torch.Tensor]] = []
        size, flat = 0, 0
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    n = self._estimated_bytes(p)
                    if current and size + n > self.chunk_bytes:
                        chunks.append(current)
                        current, size = [], 0
                    current.append((gi, flat, p))
                    size += n
                flat += 1
        if current:
            chunks.append(current)
        return chunks

    def _slot(self, index: int, nbytes: int) -> torch.Tensor:
        while len(self._slots) <= index:
            self._slots.append(torch.empty(0, dtype=torch.uint8, device=self.compute_device))
        if self._slots[index].numel() < nbytes:
            # Grows to the largest chunk once (first streamed step); later steps reuse it. The old block may still
            # be read by a queued copy: tell the caching allocator before dropping it.
            if self._copy_stream is not None and self._slots[index].numel():
                self._slots[index].record_stream(self._copy_stream)
            self._slots[index] = torch.empty(nbytes, dtype=torch.uint8, device=self.compute_device)
        return self._slots[index]

    # --- the step -------------------------------------------------------------------------------------------------

    def _load(self, chunk: list[tuple[int, int, torch.Tensor]], slot_index: int):
        """Queue host -> device copies of the chunk's existing state into a slot; returns views and a ready event."""
        items = [(p, k, v) for _, _, p in chunk for k, v in self._streamed_items(self.state.get(p, {}))]
        total = sum(_aligned(v.numel() * v.element_size()) for _, _, v in items)
        slot = self._slot(slot_index, total)
        views: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        offset = 0
        with _stream(self._copy_stream):
            for p, k, v in items:
                n = v.numel() * v.element_size()
                if self._is_parked(p, k, v) and self.map_arena:
                    # computed in place in the arena's pages (mapped for this chunk only): no copies at all
                    mm, raw = self.host_arena.map((id(p), k))
                    dev = raw.view(v.dtype).view(v.shape)
                    self._mapped[(id(p), k)] = (mm, dev)
                    views.setdefault(p, {})[k] = dev
                    continue
                dev = slot[offset : offset + n].view(v.dtype).view(v.shape)
                if self._is_parked(p, k, v):
                    self.host_arena.read((id(p), k), dev.data_ptr(), n)
                else:
                    dev.copy_(v, non_blocking=True)
                views.setdefault(p, {})[k] = dev
                offset += _aligned(n)
        ready = _record(self._copy_stream)
        return views, ready, total

    def _store(self, chunk: list[tuple[int, int, torch.Tensor]], homes: dict, done) -> None:
        """Queue device -> host copies of the chunk's state (after the compute ``done``) into its host homes."""
        if self._copy_stream is not None and done is not None:
            self._copy_stream.wait_event(done)
        with _stream(self._copy_stream):
            for _, _, p in chunk:
                state = self.state[p]
                for k, dev in self._streamed_items(state):
                    mapped = self._mapped.pop((id(p), k), None)
                    if mapped is not None and mapped[1] is dev:  # updated in place in the arena: nothing to write
                        state[k] = self._placeholders[(id(p), k)]
                        self._to_unmap.append(mapped[0])
                        continue
                    if mapped is not None:
                        self._to_unmap.append(mapped[0])
                    if self.host_arena is not None:
                        state[k] = self._park(p, k, dev)
                        continue
                    home = homes.get(p, {}).get(k)
                    if home is None:  # state created by this step: give it a host home
                        home = torch.empty(dev.shape, dtype=dev.dtype, device=self.storage_device,
                                           pin_memory=self._pin())
                    home.copy_(dev, non_blocking=True)
                    if self._copy_stream is not None:
                        # state the inner step allocated itself is dropped below while this copy is queued
                        dev.record_stream(self._copy_stream)
                    state[k] = home

    def _run_inner(self, chunk: list[tuple[int, int, torch.Tensor]]) -> None:
        by_group: dict[int, list[torch.Tensor]] = {}
        for gi, _, p in chunk:
            by_group.setdefault(gi, []).append(p)
        groups = self.param_groups
        self.inner.param_groups = [{**groups[gi], "params": ps} for gi, ps in by_group.items()]
        scaling = {k: getattr(self, k) for k in _AMP_ATTRS if hasattr(self, k)}
        for k, v in scaling.items():
            setattr(self.inner, k, v)
        try:
            self.inner.step()
        finally:
            self.inner.param_groups = groups
            for k in scaling:
                delattr(self.inner, k)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._cuda and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.compute_device)
        chunks = self._plan_chunks()
        self.last_step_chunks = []
        if not chunks:
            return loss
        compute = torch.cuda.current_stream(self.compute_device) if self._cuda else None
        if self._copy_stream is not None:
            # the state of this step must see the gradients produced on the compute stream
            self._copy_stream.wait_stream(compute)
        homes = [{p: dict(self._streamed_items(self.state.get(p, {}))) for _, _, p in c} for c in chunks]
        loaded = self._load(chunks[0], 0)
        for i, chunk in enumerate(chunks):
            views, ready, _ = loaded
            if i + 1 < len(chunks):
                # Slot (i+1) % 2 last held chunk i-1, whose write-back is already queued on the copy stream, so
                # this copy lands after it (same stream) and overlaps the compute of chunk i.
                loaded = self._load(chunks[i + 1], (i + 1) % 2)
            if compute is not None and ready is not None:
                compute.wait_event(ready)
            for p, kv in views.items():
                self.state[p].update(kv)
            self._run_inner(chunk)
            # Counted after the step, so that state the step created (first step) is included.
            state = sum(v.numel() * v.element_size()
                        for _, _, p in chunk for _, v in self._streamed_items(self.state[p]))
            resident = state + (loaded[2] if i + 1 < len(chunks) else 0)
            info = ChunkInfo(i, [flat for _, flat, _ in chunk], state, resident)
            self.last_step_chunks.append(info)
            if self.on_chunk is not None:
                self.on_chunk(info)
            self._store(chunk, homes[i], _record(compute))
            del views
            self._unmap()
        if self._copy_stream is not None:
            # host state must be complete before anyone reads it (state_dict, the next step)
            self._copy_stream.synchronize()
        if self.host_arena is not None:
            # the slots are optimizer-phase memory: gone until the next step
            self._slots = []
            self._mapped.clear()
            loaded = None
            self._unmap(force=True)
            release_free_memory()
        return loss

    def _unmap(self, force: bool = False) -> None:
        self._to_unmap = [mm for mm in self._to_unmap if not HostArena.unmap(mm)]
        if force and self._to_unmap:  # a tensor over a map lived on in a reference cycle
            import gc

            gc.collect()
        self._to_unmap = [mm for mm in self._to_unmap if not HostArena.unmap(mm)]


class _StreamedState:
    """The optimizer's state as a registry object: its home is the host; chunks visit the device inside ``step``."""

    def __init__(self, optimizer: StreamedOptimizer) -> None:
        self.optimizer = optimizer

    def nbytes(self) -> int:
        return self.optimizer.state_bytes()

    def to_device(self) -> None:  # streamed by step(), never resident as a whole
        pass

    def to_host(self) -> None:
        self.optimizer.offload_state()

    def free(self) -> None:
        raise RuntimeError("optimizer state is permanent: it can be parked on the host, never dropped")


def register_streamed_optimizer(registry: MemoryRegistry, optimizer: StreamedOptimizer,
                                ledger: MemoryLedger | None = None, name: str = "optimizer_state") -> MemoryObject:
    """Register the state as PERMANENT (home: host, also during the optimizer phase) and, with a ledger, report the
    chunks on the device as transient permanent bytes while ``step`` runs."""
    obj = registry.register(name, _StreamedState(optimizer), LifetimeClass.PERMANENT, Phase.OPTIMIZER,
                            Phase.OPTIMIZER, host_phases=[Phase.OPTIMIZER], placement=Placement.HOST)
    if ledger is not None:
        previous = optimizer.on_chunk

        def on_chunk(info: ChunkInfo) -> None:
            ledger.sample(transient={LifetimeClass.PERMANENT: info.resident_bytes})
            if previous is not None:
                previous(info)

        optimizer.on_chunk = on_chunk
    return obj


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _stream(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else _NullContext()


def _record(stream: torch.cuda.Stream | None):
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event

"""Boundary-state placement: the actor prefix's saved activations wait on the host during the decode window.

The actor prefix runs with autograd inside the rollout's decode window, but its backward comes only after the
suffix loss. Everything autograd saves for that backward is therefore idle device memory for the whole decode
window, exactly when the rollout's KV cache needs the room. ``SavedTensorOffload`` installs
``torch.autograd.graph.saved_tensors_hooks``: *pack* copies each saved tensor to (pinned) host memory and hands
autograd a small handle, so the device copy can be freed; *unpack* (or an earlier ``prefetch()``) brings it back for
the backward. The copies are exact, so gradients are bit-identical (tested on CPU).

    offload = SavedTensorOffload(min_bytes=1 << 20)
    with offload.hooks():
        prefix = model(prompt)          # actor prefix, graph kept, activations parked on the host
    ...                                 # decode, scoring
    offload.prefetch()                  # optional: all back on the device ahead of the backward
    loss.backward()
    offload.release()

On CPU, where host and device are the same RAM, pass ``arena=HostArena()``: each saved tensor's bytes are written to
the arena's file (never mapped into the process) and the in-process copy is dropped, so the resident set really
drops until the backward reads them back (the trainer's activation offload, ``rollplex_offload_activations``).
A slot is dropped after its last unpack; ``release()`` empties the arena.

Skipped (returned unchanged): leaves that require grad (the weights, owned by the weight snapshot's lifetime) and
tensors smaller than ``min_bytes``. A tensor saved by several ops (the input of q/k/v projections) is parked once.
As a registry object (``MemoryRegistry.register(..., target=offload)``) its placements map to:
``to_host`` = drop device copies, ``to_device`` = ``prefetch``, ``free`` = ``release``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rollplex_trl.memory.storage import HostArena
from rollplex_trl.torch_compat import tensor_version


class _Parked:
    """One saved tensor: its host copy (or its slot in a host arena), and its device copy while it is back."""

    def __init__(self, host: torch.Tensor | None, device: torch.device, copied: torch.cuda.Event | None,
                 arena_key: int | None = None, shape: torch.Size | None = None,
                 dtype: torch.dtype | None = None, stride: tuple[int, ...] | None = None) -> None:
        self.host = host
        self.device = device
        self.copied = copied  # D2H completion (CUDA)
        self.arena_key = arena_key  # CPU with an arena: the bytes wait in its file, `host` is None
        self.shape = host.shape if host is not None else shape
        self.dtype = host.dtype if host is not None else dtype
        self.stride = host.stride() if host is not None else stride
        self.device_copy: torch.Tensor | None = None  # strong ref while prefetched
        self.pending_unpacks = 0

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


class SavedTensorOffload:
    def __init__(self, host_device: torch.device | str = "cpu", min_bytes: int = 1 << 20,
                 arena: HostArena | None = None) -> None:
        self.host_device = torch.device(host_device)
        self.min_bytes = min_bytes
        self.arena = arena  # CPU tensors park here (module docstring)
        self._keys = itertools.count()
        self.parked_bytes_total = 0  # every byte parked since the last `release` (a metric)
        self._parked: list[_Parked] = []
        self._by_id: dict[int, tuple[weakref.ref, int, _Parked]] = {}
        self._side: torch.cuda.Stream | None = None

    # --- hooks ----------------------------------------------------------------------------------------------------

    @contextmanager
    def hooks(self) -> Iterator[SavedTensorOffload]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side

    def _pack(self, t: torch.Tensor):
        weight = isinstance(t, torch.nn.Parameter) or (t.requires_grad and t.is_leaf)
        if weight or t.numel() * t.element_size() < self.min_bytes:
            return t
        # Same tensor saved by several ops: park it once. The weakref proves the id still names this tensor, the
        # version counter that it was not modified in place since.
        seen = self._by_id.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == tensor_version(t):
            seen[2].pending_unpacks += 1
            return seen[2]
        cuda = t.device.type == "cuda" and self.host_device.type == "cpu"
        if self.arena is not None and t.device.type == "cpu":
            parked = self._park_in_arena(t)
        else:
            parked = self._park_on_host(t, cuda)
        parked.pending_unpacks = 1
        self._parked.append(parked)
        self._by_id[id(t)] = (weakref.ref(t), tensor_version(t), parked)
        self.parked_bytes_total += parked.nbytes
        return parked

    def _park_in_arena(self, t: torch.Tensor) -> _Parked:
        dense = _dense(t)  # its bytes are one span from data_ptr
        key = next(self._keys)
        self.arena.write(key, dense.data_ptr(), dense.numel() * dense.element_size())
        return _Parked(None, t.device, None, arena_key=key, shape=t.shape, dtype=t.dtype, stride=dense.stride())

    def _park_on_host(self, t: torch.Tensor, cuda: bool) -> _Parked:
        dense = _dense(t)
        host = torch.empty_strided(dense.shape, dense.stride(), dtype=t.dtype, device=self.host_device,
                                   pin_memory=cuda)
        t = dense
        event = None
        if cuda:
            side = self._side_stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))  # t must be computed before it is copied
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
            t.record_stream(side)  # autograd drops t right away; keep its block until the copy is done
            event = torch.cuda.Event()
            event.record(side)
        else:
            host.copy_(t)
        return _Parked(host, t.device, event)

    def _unpack(self, handle):
        if isinstance(handle, torch.Tensor):
            return handle
        dev = handle.device_copy
        if dev is None:
            dev = self._copy_back(handle)
        handle.pending_unpacks -= 1
        if handle.pending_unpacks <= 0:
            # its last reader: let the device copy go with the autograd node (host copy stays until release; an
            # arena slot is dropped now)
            handle.device_copy = None
            if handle.arena_key is not None:
                self.arena.drop(handle.arena_key)
        return dev

    def _copy_back(self, handle: _Parked, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        if handle.copied is not None:
            handle.copied.synchronize()
        if handle.arena_key is not None:
            out = torch.empty_strided(handle.shape, handle.stride, dtype=handle.dtype, device=handle.device)
            self.arena.read(handle.arena_key, out.data_ptr(), handle.nbytes)
            return out
        if handle.device.type != "cuda":
            return handle.host.to(handle.device, copy=True)
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            return handle.host.to(handle.device, non_blocking=True)

    # --- placement ------------------------------------------------------------------------------------------------

    def prefetch(self) -> None:
        """Bring every parked tensor back to its device now (on a side stream on CUDA), ahead of the backward."""
        pending = [h for h in self._parked if h.device_copy is None and h.pending_unpacks > 0]
        cuda = [h for h in pending if h.device.type == "cuda"]
        for h in pending:
            if h.device.type != "cuda":
                h.device_copy = self._copy_back(h)
        if cuda:
            side = self._side_stream(cuda[0].device)
            for h in cuda:
                h.device_copy = self._copy_back(h, side)
            current = torch.cuda.current_stream(cuda[0].device)
            current.wait_stream(side)
            for h in cuda:
                h.device_copy.record_stream(current)

    def to_host(self) -> None:
        for h in self._parked:
            h.device_copy = None

    def to_device(self) -> None:
        self.prefetch()

    def free(self) -> None:
        self.release()

    def release(self) -> None:
        """Forget every parked tensor (after the backward). Autograd nodes still holding handles keep theirs (not
        with an arena: its slots are gone, so release only after every backward that reads them)."""
        self._parked.clear()
        self._by_id.clear()
        self.parked_bytes_total = 0
        if self.arena is not None:
            self.arena.clear()

    def nbytes(self) -> int:
        return sum(h.nbytes for h in self._parked)

    def device_bytes(self) -> int:
        """Bytes of parked tensors on the compute device now (brought back, or never moved off it)."""
        return sum(h.nbytes for h in self._parked if h.device_copy is not None)

    @property
    def num_parked(self) -> int:
        return len(self._parked)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """`t` itself where its elements fill one span without gaps (any dimension order), else a contiguous copy.

    Unpacking with the saved tensor's own strides matters for exactness: a backward kernel given a transposed
    operand in another memory order can sum in another order (bf16 grad norms differed by 1.6e-5 when the
    unpacked tensors were all made contiguous)."""
    return t if _fills_one_span(t) else t.contiguous()


def _fills_one_span(t: torch.Tensor) -> bool:
    """Whether `t`'s elements are a permutation of a contiguous block (no gaps, no overlap)."""
    expected = 1
    for size, stride in sorted((d for d in zip(t.shape, t.stride(), strict=True) if d[0] != 1),
                               key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

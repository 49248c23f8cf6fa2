"""Moving the bytes of tensors between the device and the host without replacing the tensor objects.

The move works on the *storage* of each tensor: offloading copies the storage into a host buffer and resizes the
device storage to zero bytes; reloading resizes it back and copies the bytes in. The ``torch.Tensor`` objects, their
views, ``nn.Parameter`` identity, optimizer state keyed by parameter and autograd hooks all stay valid, because they
hold the storage object, not its address (FSDP frees unsharded parameters the same way).

What this does *not* keep is the raw device address: a reloaded storage is a new allocation. Code that holds the
address itself (CUDA graphs, IPC handles shared with a rollout engine) needs the storage to live in a
``VmmBuffer`` (``cuda_vmm.py``), whose virtual range stays reserved while the physical pages go away.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch

from rollplex_trl.memory.lifetime import Placement


class Movable(Protocol):
    """Anything the residency manager can place: a set of tensors, saved activations, a rollout engine's KV cache."""

    def nbytes(self) -> int: ...

    def to_device(self) -> None: ...

    def to_host(self) -> None: ...

    def free(self) -> None: ...


def host_buffer(nbytes: int, like_device: torch.device, host_device: torch.device) -> torch.Tensor:
    """A byte buffer on the host; page-locked when the data comes from CUDA, so copies can be asynchronous."""
    pin = like_device.type == "cuda" and host_device.type == "cpu" and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, device=host_device, pin_memory=pin)


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class TensorGroup:
    """The storages of some tensors, moved together. Tensors that share a storage are moved once.

    ``tensors`` may be a callable so that per-step objects (this step's prefix state) are looked up when moved.
    ``regenerate`` refills the bytes after a FREED -> DEVICE move (e.g. copy bf16 weights out of the fp32 master);
    without it a freed-then-reloaded tensor holds uninitialised memory, which is right for scratch buffers only.
    ``keep_host_copy`` keeps the host buffer after a reload, for objects whose home is the host (permanent state):
    the next offload then reuses the pinned buffer instead of allocating one.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor] | Callable[[], Iterable[torch.Tensor]],
        *,
        host_device: torch.device | str = "cpu",
        regenerate: Callable[[], None] | None = None,
        keep_host_copy: bool = False,
    ) -> None:
        self._tensors = tensors
        self.host_device = torch.device(host_device)
        self.regenerate = regenerate
        self.keep_host_copy = keep_host_copy
        self.placement = Placement.DEVICE
        # storage -> its byte size while on the device; host buffers keyed by the same storage objects.
        self._sizes: dict[int, int] = {}
        self._host: dict[int, torch.Tensor] = {}

    def tensors(self) -> list[torch.Tensor]:
        return list(self._tensors() if callable(self._tensors) else self._tensors)

    def _storages(self) -> list[torch.UntypedStorage]:
        seen: dict[int, torch.UntypedStorage] = {}
        for t in self.tensors():
            s = t.untyped_storage()
            # _cdata identifies the StorageImpl; views of one tensor share it, so they move once.
            seen.setdefault(s._cdata, s)
        return list(seen.values())

    def nbytes(self) -> int:
        """Bytes this group occupies wherever it currently is (0 when freed)."""
        if self.placement is Placement.DEVICE:
            return sum(s.nbytes() for s in self._storages())
        if self.placement is Placement.HOST:
            return sum(self._sizes.values())
        return 0

    def to_host(self) -> None:
        if self.placement is not Placement.DEVICE:
            return
        storages = self._storages()
        self._sizes = {}
        for s in storages:
            key, n = s._cdata, s.nbytes()
            buf = self._host.get(key)
            if buf is None or buf.numel() != n:
                buf = host_buffer(n, s.device, self.host_device)
                self._host[key] = buf
            buf.copy_(_byte_view(s), non_blocking=True)
            self._sizes[key] = n
        _wait_for_copies(storages)
        for s in storages:
            s.resize_(0)
        self.placement = Placement.HOST

    def to_device(self) -> None:
        if self.placement is Placement.DEVICE:
            return
        from_host = self.placement is Placement.HOST
        storages = self._storages()
        for s in storages:
            key = s._cdata
            if key not in self._sizes:
                continue  # a storage this group never moved (a callable group's new tensors): already in place
            s.resize_(self._sizes[key])
            if from_host and key in self._host:
                _byte_view(s).copy_(self._host[key], non_blocking=True)
        _wait_for_copies(storages)
        if not self.keep_host_copy:
            self._host.clear()
        self.placement = Placement.DEVICE
        if not from_host and self.regenerate is not None:
            self.regenerate()

    def free(self) -> None:
        if self.placement is Placement.DEVICE:
            storages = self._storages()
            self._sizes = {s._cdata: s.nbytes() for s in storages}
            for s in storages:
                s.resize_(0)
        self._host.clear()
        self.placement = Placement.FREED


def _wait_for_copies(storages: list[torch.UntypedStorage]) -> None:
    # non_blocking copies from/to pinned memory are asynchronous on CUDA; the device storage may be released and
    # the host bytes read only after they finished.
    if any(s.device.type == "cuda" for s in storages):
        torch.cuda.current_stream().synchronize()

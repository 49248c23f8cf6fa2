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

import ctypes
import ctypes.util
import mmap
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from rollplex_trl.memory.lifetime import Placement
from rollplex_trl.torch_compat import storage_key


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
    ``arena`` (a ``HostArena``; CPU compute) parks the bytes in the arena instead of a host tensor, so an offload
    lowers the process's resident memory; ``immutable=True`` says the contents never change between offloads
    (a frozen reference model), so only the first offload writes them and later ones just release the storage.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor] | Callable[[], Iterable[torch.Tensor]],
        *,
        host_device: torch.device | str = "cpu",
        regenerate: Callable[[], None] | None = None,
        keep_host_copy: bool = False,
        arena: HostArena | None = None,
        immutable: bool = False,
    ) -> None:
        self._tensors = tensors
        self.arena = arena
        self.immutable = immutable
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
            # storage_key identifies the StorageImpl; views of one tensor share it, so they move once.
            seen.setdefault(storage_key(s), s)
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
        if self.arena is not None:
            for s in storages:
                key = (id(self), storage_key(s))
                if not (self.immutable and key in self.arena):
                    self.arena.write_storage(key, s)
                self._sizes[storage_key(s)] = s.nbytes()
                s.resize_(0)
            release_free_memory()
            self.placement = Placement.HOST
            return
        for s in storages:
            key, n = storage_key(s), s.nbytes()
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
            key = storage_key(s)
            if key not in self._sizes:
                continue  # a storage this group never moved (a callable group's new tensors): already in place
            s.resize_(self._sizes[key])
            if from_host and self.arena is not None:
                self.arena.read_storage((id(self), key), s)
            elif from_host and key in self._host:
                _byte_view(s).copy_(self._host[key], non_blocking=True)
        _wait_for_copies(storages)
        if not self.keep_host_copy:
            self._host.clear()
            if from_host and self.arena is not None and not self.immutable:
                for key in self._sizes:
                    self.arena.drop((id(self), key))
        self.placement = Placement.DEVICE
        if not from_host and self.regenerate is not None:
            self.regenerate()

    def free(self) -> None:
        if self.placement is Placement.DEVICE:
            storages = self._storages()
            self._sizes = {storage_key(s): s.nbytes() for s in storages}
            for s in storages:
                s.resize_(0)
        self._host.clear()
        if self.arena is not None:
            for key in self._sizes:
                self.arena.drop((id(self), key))
            release_free_memory()
        self.placement = Placement.FREED


def _wait_for_copies(storages: list[torch.UntypedStorage]) -> None:
    # non_blocking copies from/to pinned memory are asynchronous on CUDA; the device storage may be released and
    # the host bytes read only after they finished.
    if any(s.device.type == "cuda" for s in storages):
        torch.cuda.current_stream().synchronize()


# --- the host arena (CPU compute) ---------------------------------------------------------------------------------

_libc: ctypes.CDLL | None = None


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), so that released storages leave the RSS.

    Large blocks are ``mmap``-ed and unmapped on free anyway; smaller ones sit in malloc's arenas until trimmed.
    A no-op where glibc is not the allocator."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False  # type: ignore[assignment]
    if _libc:
        _libc.malloc_trim(0)


def _default_arena_dir() -> str:
    configured = os.environ.get("ROLLPLEX_ARENA_DIR")
    if configured:
        return configured
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _check_cpu(storage: torch.UntypedStorage) -> None:
    if storage.device.type != "cpu":
        raise ValueError(f"the host arena parks CPU storages; got one on {storage.device} (CUDA parks in pinned "
                         "host buffers instead)")


def _buffer(ptr: int, nbytes: int):
    # A ctypes view of the bytes. Not ``tensor.numpy()``: exporting a storage to numpy marks it non-resizable for
    # good, and the whole point is to resize it to zero afterwards.
    return (ctypes.c_char * nbytes).from_address(ptr)


class HostArena:
    """Parked bytes on the host, outside the process's resident memory: a file written with ``pwrite`` and read back
    with ``preadv``, never mapped into the process. On CPU, where "host" and "device" are the same RAM, this is what
    makes an offload show: the storage is resized to zero (its pages go back to the OS) and the bytes wait in the
    file (default ``/dev/shm``, i.e. shared memory; ``ROLLPLEX_ARENA_DIR`` or ``directory=`` to choose, e.g. a disk
    for file-backed memory the kernel may page out). The file is unlinked at once: it vanishes with the process.

    Slots are keyed by the caller (any hashable); a key written again with the same size reuses its slot.
    Round trips are byte copies, so they are exact.
    """

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        fd, path = tempfile.mkstemp(prefix="rollplex-arena-", dir=str(directory or _default_arena_dir()))
        os.unlink(path)
        self.fd = fd
        self.path = path
        self._slots: dict[Any, tuple[int, int]] = {}  # key -> (offset, nbytes)
        self._free: list[tuple[int, int]] = []
        self._end = 0

    def __contains__(self, key: Any) -> bool:
        return key in self._slots

    def nbytes(self) -> int:
        """Bytes held for live keys."""
        return sum(n for _, n in self._slots.values())

    def _slot(self, key: Any, nbytes: int) -> int:
        slot = self._slots.get(key)
        if slot is not None and slot[1] == nbytes:
            return slot[0]
        if slot is not None:
            self.drop(key)
        for i, (offset, n) in enumerate(self._free):
            if n == nbytes:
                del self._free[i]
                self._slots[key] = (offset, nbytes)
                return offset
        offset = self._end
        # page-aligned slots: ``map`` needs its offset on a page boundary
        self._end += -(-nbytes // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
        self._slots[key] = (offset, nbytes)
        return offset

    def write(self, key: Any, ptr: int, nbytes: int) -> None:
        """Copy ``nbytes`` from the address ``ptr`` (a CPU storage's ``data_ptr()``) into the key's slot."""
        offset = self._slot(key, nbytes)
        view, done = memoryview(_buffer(ptr, nbytes)).cast("B"), 0
        while done < nbytes:
            done += os.pwrite(self.fd, view[done:], offset + done)

    def read(self, key: Any, ptr: int, nbytes: int) -> None:
        """Copy the key's bytes to the address ``ptr`` (``nbytes`` must be the size written)."""
        offset, size = self._slots[key]
        if size != nbytes:
            raise ValueError(f"arena slot {key!r} holds {size} bytes, {nbytes} requested")
        view, done = memoryview(_buffer(ptr, nbytes)).cast("B"), 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"short read from the host arena at slot {key!r}")
            done += got

    def map(self, key: Any) -> tuple[mmap.mmap, torch.Tensor]:
        """The key's bytes mapped into the process (shared, pre-faulted), as a uint8 tensor over them: compute on
        them in place, then drop every tensor over the map and ``unmap`` it; the pages leave the process again
        (they stay in the arena's file). Saves the two copies of a read + write round trip."""
        offset, nbytes = self._slots[key]
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(self.fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        return mm, torch.frombuffer(mm, dtype=torch.uint8)

    @staticmethod
    def unmap(mm: mmap.mmap) -> bool:
        """Unmap; False while a tensor over it is still alive (then it is unmapped when collected)."""
        try:
            mm.close()
            return True
        except BufferError:
            return False

    def write_storage(self, key: Any, storage: torch.UntypedStorage) -> None:
        _check_cpu(storage)
        self.write(key, storage.data_ptr(), storage.nbytes())

    def read_storage(self, key: Any, storage: torch.UntypedStorage) -> None:
        _check_cpu(storage)
        self.read(key, storage.data_ptr(), storage.nbytes())

    def drop(self, key: Any) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        """Drop every slot and give the file's pages back (its size goes to zero)."""
        self._slots.clear()
        self._free.clear()
        self._end = 0
        if self.fd >= 0:
            os.ftruncate(self.fd, 0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self._slots.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def group_into_buckets(sizes: Iterable[tuple[Any, int]], bucket_bytes: int) -> list[list[Any]]:
    """Consecutive groups of keys (names, indices) whose byte sizes add up to at most `bucket_bytes` (a larger item
    is alone)."""
    buckets: list[list[Any]] = []
    current: list[Any] = []
    used = 0
    for name, size in sizes:
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        buckets.append(current)
    return buckets

"""The project's one binding of the CUDA driver's virtual-memory API (ctypes over ``libcuda.so.1``).

Two users, one set of driver calls:

- the residency manager (:mod:`rollplex_trl.memory`): :class:`VmmBuffer` is device memory at a fixed virtual address
  whose physical pages can be released and re-created, as vLLM's sleep mode does with its pluggable allocator
  (``vllm/device_allocator/cumem.py``) but one reservation per buffer:

      reserve a virtual range (cuMemAddressReserve) once
      map:    cuMemCreate physical pages -> cuMemMap into the range -> cuMemSetAccess
      unmap:  copy out to pinned host memory -> cuMemUnmap + cuMemRelease (the range stays reserved)
      remap:  new physical pages mapped at the *same* address -> copy back in

  Tensors built over the buffer (``VmmBuffer.tensor``) therefore keep their ``data_ptr`` across
  ``offload``/``reload``: views, IPC-shared mappings and CUDA graphs captured over them stay valid. Touching them
  while unmapped is an illegal memory access, so the residency manager only unmaps outside an object's window.
- the weight-sharing executor (:mod:`rollplex_trl.sharding.executor`, same shape as :mod:`rollplex_trl.sharding.shm`):
  a :class:`CudaFile` is ``cuMemCreate`` memory exportable as a POSIX file descriptor, mapped whole on its device; a
  peer opens it by name (the owner's UNIX-socket server hands the descriptor over with ``SCM_RIGHTS``, the peer
  imports it with ``cuMemImportFromShareableHandle`` and maps it with access for its own device, NVLink P2P); a
  :class:`CudaRange` is a reserved range that granule-aligned pieces of such allocations are mapped into, in any
  order.

Tensors over these addresses are built through ``__cuda_array_interface__`` (no copy).

Status: written, NOT RUN. The project's machines have no GPU and no device machine was available to the tasks that
wrote and merged it; the module imports on CPU-only hosts and raises :class:`VmmUnavailable` when used there. On a
GPU, ``python -m rollplex_trl.sharding.gpu_check`` and ``tests/memory/test_memory_cuda.py`` check it. Every driver
entry point is declared with its ``cuda.h`` (CUDA 12/13) prototype, and the struct layouts follow ``cuda.h``:
CUmemAllocationProp, CUmemLocation, CUmemAccessDesc.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from functools import cache

import torch

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_HANDLE_TYPE_NONE = 0
_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class VmmUnavailable(RuntimeError):
    """No CUDA device, or no CUDA driver library, in this process."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_u64, _size, _int, _ptr = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
_PROTOTYPES = {  # CUdeviceptr and CUmemGenericAllocationHandle are unsigned long long on 64-bit hosts
    "cuGetErrorName": [_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuMemGetAllocationGranularity": [ctypes.POINTER(_size), ctypes.POINTER(_AllocationProp), _int],
    "cuMemAddressReserve": [ctypes.POINTER(_u64), _size, _size, _u64, _u64],
    "cuMemAddressFree": [_u64, _size],
    "cuMemCreate": [ctypes.POINTER(_u64), _size, ctypes.POINTER(_AllocationProp), _u64],
    "cuMemRelease": [_u64],
    "cuMemMap": [_u64, _size, _size, _u64, _u64],
    "cuMemUnmap": [_u64, _size],
    "cuMemSetAccess": [_u64, _size, ctypes.POINTER(_AccessDesc), _size],
    "cuMemExportToShareableHandle": [_ptr, _u64, _int, _u64],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_u64), _ptr, _int],
}


@cache
def _libcuda() -> ctypes.CDLL:
    if not torch.cuda.is_available():
        raise VmmUnavailable("the CUDA virtual-memory API needs a CUDA device; none is visible to torch")
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise VmmUnavailable(f"cannot load the CUDA driver library libcuda.so.1: {exc}") from exc
    # Declared prototypes: without them ctypes passes Python ints as 32-bit C ints, truncating addresses.
    for name, argtypes in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _libcuda().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed with CUDA driver error {result} ({(name.value or b'?').decode()})")


def _prop(device: int, exportable: bool = False) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, device)
    prop.requestedHandleTypes = _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if exportable else _CU_MEM_HANDLE_TYPE_NONE
    return prop


def _ensure_context(device: int) -> None:
    # Driver calls need a current context; a torch allocation on the device creates its primary context and makes
    # it current on this thread (torch initialises CUDA lazily).
    torch.cuda.init()
    torch.empty(1, device=f"cuda:{device}")


def granularity(device: int, recommended: bool = False) -> int:
    """Mapping unit on this device: the minimum, or the recommended one (both 2 MiB on current NVIDIA GPUs)."""
    _libcuda()
    _ensure_context(device)
    size = ctypes.c_size_t()
    prop = _prop(device, exportable=recommended)
    flag = _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED if recommended else _CU_MEM_ALLOC_GRANULARITY_MINIMUM
    _check(_libcuda().cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(prop), flag),
           "cuMemGetAllocationGranularity")
    return size.value


def _reserve(size: int, alignment: int) -> int:
    ptr = ctypes.c_uint64()
    _check(_libcuda().cuMemAddressReserve(ctypes.byref(ptr), size, alignment, 0, 0), "cuMemAddressReserve")
    return ptr.value


def _create(size: int, device: int, exportable: bool = False) -> int:
    handle = ctypes.c_uint64()
    prop = _prop(device, exportable)
    _check(_libcuda().cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0), "cuMemCreate")
    return handle.value


def _map(ptr: int, size: int, offset: int, handle: int, device: int) -> None:
    """Map ``size`` bytes of allocation ``handle`` from ``offset`` at ``ptr``, readable and writable by ``device``."""
    lib = _libcuda()
    _check(lib.cuMemMap(ptr, size, offset, handle, 0), "cuMemMap")
    access = _AccessDesc(_Location(_CU_MEM_LOCATION_TYPE_DEVICE, device), _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    _check(lib.cuMemSetAccess(ptr, size, ctypes.byref(access), 1), "cuMemSetAccess")


class _CudaArray:
    """Exposes a raw device pointer through ``__cuda_array_interface__`` so torch can view it without copying."""

    def __init__(self, ptr: int, nbytes: int, owner: object = None) -> None:
        self._owner = owner  # keeps the reservation alive as long as any tensor views it
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


def tensor_at(ptr: int, nbytes: int, device: int, owner: object = None) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of device memory at ``ptr`` (no copy)."""
    return torch.as_tensor(_CudaArray(ptr, nbytes, owner), device=f"cuda:{device}")


# ------------------------------------------------------------------------------------ residency: VmmBuffer
class VmmBuffer:
    """``nbytes`` of device memory at a fixed virtual address; physical pages can be released and re-created."""

    def __init__(self, nbytes: int, device: int | None = None) -> None:
        _libcuda()
        self.device = torch.cuda.current_device() if device is None else device
        gran = granularity(self.device)
        self.nbytes = nbytes
        self.size = -(-nbytes // gran) * gran  # mappings are whole granules
        self.ptr = _reserve(self.size, gran)
        self._handle: int | None = None
        self._host: torch.Tensor | None = None
        self._map()
        self.tensor = tensor_at(self.ptr, nbytes, self.device, owner=self)

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def _map(self) -> None:
        handle = _create(self.size, self.device)
        _map(self.ptr, self.size, 0, handle, self.device)
        self._handle = handle

    def _unmap(self) -> None:
        lib = _libcuda()
        _check(lib.cuMemUnmap(self.ptr, self.size), "cuMemUnmap")
        _check(lib.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None

    def offload(self, keep: bool = True) -> None:
        """Release the physical pages; with ``keep`` the bytes are copied to pinned host memory first."""
        if not self.mapped:
            return
        if keep:
            if self._host is None:
                self._host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            self._host.copy_(self.tensor, non_blocking=True)
        # Every queued kernel that may touch the pages must be done before they go away.
        torch.cuda.synchronize(self.device)
        self._unmap()

    def reload(self) -> None:
        """Map fresh physical pages at the same address and copy the kept bytes back (if any)."""
        if self.mapped:
            return
        self._map()
        if self._host is not None:
            self.tensor.copy_(self._host, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        if self.mapped:
            torch.cuda.synchronize(self.device)
            self._unmap()
        _check(_libcuda().cuMemAddressFree(self.ptr, self.size), "cuMemAddressFree")


class VmmTensorGroup:
    """A ``Movable`` whose tensors were re-homed into one ``VmmBuffer``: offload/reload keep every data_ptr.

    ``adopt`` copies each tensor into the buffer and points ``tensor.data`` at it, so it must run before anything
    takes views of (or captures graphs over) those tensors. NOT RUN: see the module docstring.
    """

    def __init__(self, tensors: list[torch.Tensor], alignment: int = 256) -> None:
        offsets, total = [], 0
        for t in tensors:
            total = -(-total // alignment) * alignment
            offsets.append(total)
            total += t.numel() * t.element_size()
        self.buffer = VmmBuffer(total, tensors[0].device.index if tensors else None)
        for t, off in zip(tensors, offsets, strict=True):
            n = t.numel() * t.element_size()
            view = self.buffer.tensor[off : off + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view
        self.tensors = tensors

    def nbytes(self) -> int:
        return self.buffer.nbytes if self.buffer.mapped or self.buffer._host is not None else 0

    def to_host(self) -> None:
        self.buffer.offload(keep=True)

    def to_device(self) -> None:
        self.buffer.reload()

    def free(self) -> None:
        self.buffer._host = None
        self.buffer.offload(keep=False)


# ------------------------------------------------------------------------- weight sharing: CudaFile, CudaRange
def _socket_name(name: str) -> str:
    return "\0rollplex-vmm-" + name.strip("/").replace("/", "-")  # Linux abstract socket: nothing on disk


class CudaFile:
    """A physical allocation, mapped whole on ``device``; peers open it by name (descriptor over a UNIX socket)."""

    def __init__(self, name: str, size: int, device: int, handle: int, owner: bool) -> None:
        self.name, self.size, self.device, self.handle, self.owner = name, size, device, handle, owner
        self.addr = _reserve(size, granularity(device, recommended=True))
        _map(self.addr, size, 0, handle, device)
        self._server: socket.socket | None = None
        self._fd = -1

    @classmethod
    def create(cls, name: str, size: int, device: int) -> CudaFile:
        gran = granularity(device, recommended=True)
        size = max(gran, -(-size // gran) * gran)
        f = cls(name, size, device, _create(size, device, exportable=True), True)
        f._serve()
        return f

    @classmethod
    def open(cls, name: str, device: int) -> CudaFile:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(_socket_name(name))
            msg, fds, _, _ = socket.recv_fds(s, 64, 1)
        size = int(msg.decode())
        handle = ctypes.c_uint64()
        try:
            # For a POSIX descriptor the "OS handle" argument is the descriptor itself, passed as a pointer value.
            _check(_libcuda().cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fds[0]),
                                                             _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                   "cuMemImportFromShareableHandle")
        finally:
            os.close(fds[0])
        return cls(name, size, device, handle.value, False)

    def _serve(self) -> None:
        fd = ctypes.c_int(-1)
        _check(_libcuda().cuMemExportToShareableHandle(ctypes.byref(fd), self.handle,
                                                       _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
               "cuMemExportToShareableHandle")
        self._fd = fd.value
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(_socket_name(self.name))
        server.listen(64)
        self._server = server

        def loop() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return  # closed
                with conn:
                    socket.send_fds(conn, [str(self.size).encode()], [self._fd])

        threading.Thread(target=loop, daemon=True).start()

    def bytes(self) -> torch.Tensor:
        return tensor_at(self.addr, self.size, self.device, owner=self)

    def unlink(self) -> None:
        """Stop handing the allocation to new peers (the POSIX file's unlink): every peer that needs it imported
        it already; the memory lives until the last mapping goes."""
        if self._server is not None:
            self._server.close()  # an abstract socket: closing it removes the name
            self._server = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.addr:
            lib = _libcuda()
            _check(lib.cuMemUnmap(self.addr, self.size), "cuMemUnmap")
            _check(lib.cuMemAddressFree(self.addr, self.size), "cuMemAddressFree")
            _check(lib.cuMemRelease(self.handle), "cuMemRelease")
            self.addr = 0


class CudaRange:
    """A reserved device address range; pieces of allocations are mapped into it in any order."""

    def __init__(self, nbytes: int, device: int) -> None:
        self.device = device
        gran = granularity(device, recommended=True)
        self.size = max(gran, -(-nbytes // gran) * gran)
        self.addr = _reserve(self.size, gran)
        self._mapped: list[tuple[int, int]] = []

    def map(self, va: int, file: CudaFile, offset: int, nbytes: int) -> None:
        # A non-zero offset into the allocation is allowed by the CUDA 12/13 driver when granule-aligned.
        _map(self.addr + va, nbytes, offset, file.handle, self.device)
        self._mapped.append((self.addr + va, nbytes))

    def bytes(self) -> torch.Tensor:
        return tensor_at(self.addr, self.size, self.device, owner=self)

    def close(self) -> None:
        lib = _libcuda()
        for ptr, n in self._mapped:
            _check(lib.cuMemUnmap(ptr, n), "cuMemUnmap")
        self._mapped = []
        if self.addr:
            _check(lib.cuMemAddressFree(self.addr, self.size), "cuMemAddressFree")
            self.addr = 0

"""Device buffers whose virtual address survives an offload (CUDA driver virtual-memory API, via ctypes).

vLLM's sleep mode does this with a pluggable allocator (``vllm/device_allocator/cumem.py``); here one buffer is one
reservation, which is enough for the large, long-lived objects the residency manager moves (bf16 snapshots that a
rollout engine views, boundary buffers read by captured graphs):

    reserve a virtual range (cuMemAddressReserve) once
    map:    cuMemCreate physical pages -> cuMemMap into the range -> cuMemSetAccess
    unmap:  copy out to pinned host memory -> cuMemUnmap + cuMemRelease (the range stays reserved)
    remap:  new physical pages mapped at the *same* address -> copy back in

Tensors built over the buffer (``VmmBuffer.tensor``) therefore keep their ``data_ptr`` across ``offload``/``reload``:
views, IPC-shared mappings and CUDA graphs captured over them stay valid. Touching them while unmapped is an illegal
memory access, so the residency manager only unmaps outside an object's window.

Status: NOT RUN. This machine has no GPU and the project's device machine was not available to this task; the
module imports on CPU-only hosts and raises ``VmmUnavailable`` when used there. The ctypes struct layouts follow
``cuda.h`` (CUDA 12/13): CUmemAllocationProp, CUmemLocation, CUmemAccessDesc.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class VmmUnavailable(RuntimeError):
    pass


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


@cache
def _libcuda() -> ctypes.CDLL:
    if not torch.cuda.is_available():
        raise VmmUnavailable("the CUDA virtual-memory API needs a CUDA device; none is visible to torch")
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise VmmUnavailable(f"cannot load the CUDA driver library libcuda.so.1: {exc}") from exc


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _libcuda().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed with CUDA driver error {result} ({(name.value or b'?').decode()})")


def _prop(device: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, device)
    return prop


def granularity(device: int) -> int:
    """Smallest mapping unit on this device (2 MiB on current NVIDIA GPUs)."""
    size = ctypes.c_size_t()
    prop = _prop(device)
    _check(_libcuda().cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(prop),
                                                    _CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
    return size.value


class _CudaArray:
    """Exposes a raw device pointer through ``__cuda_array_interface__`` so torch can view it without copying."""

    def __init__(self, ptr: int, nbytes: int, owner: VmmBuffer) -> None:
        self._owner = owner  # keeps the reservation alive as long as any tensor views it
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class VmmBuffer:
    """``nbytes`` of device memory at a fixed virtual address; physical pages can be released and re-created."""

    def __init__(self, nbytes: int, device: int | None = None) -> None:
        lib = _libcuda()
        self.device = torch.cuda.current_device() if device is None else device
        torch.cuda.init()
        with torch.cuda.device(self.device):
            torch.empty(1, device="cuda")  # makes the primary context current on this thread
        gran = granularity(self.device)
        self.nbytes = nbytes
        self.size = -(-nbytes // gran) * gran  # mappings are whole granules
        ptr = ctypes.c_uint64()
        _check(lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(self.size), ctypes.c_size_t(gran),
                                       ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
        self.ptr = ptr.value
        self._handle: int | None = None
        self._host: torch.Tensor | None = None
        self._map()
        self.tensor = torch.as_tensor(_CudaArray(self.ptr, nbytes, self), device=f"cuda:{self.device}")

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def _map(self) -> None:
        lib = _libcuda()
        handle = ctypes.c_uint64()
        prop = _prop(self.device)
        _check(lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.size), ctypes.byref(prop),
                               ctypes.c_uint64(0)), "cuMemCreate")
        _check(lib.cuMemMap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size), ctypes.c_size_t(0), handle,
                            ctypes.c_uint64(0)), "cuMemMap")
        access = _AccessDesc(_Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.device), _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        _check(lib.cuMemSetAccess(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size), ctypes.byref(access),
                                  ctypes.c_size_t(1)), "cuMemSetAccess")
        self._handle = handle.value

    def _unmap(self) -> None:
        lib = _libcuda()
        _check(lib.cuMemUnmap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size)), "cuMemUnmap")
        _check(lib.cuMemRelease(ctypes.c_uint64(self._handle)), "cuMemRelease")
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
        _check(_libcuda().cuMemAddressFree(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size)),
               "cuMemAddressFree")


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

"""CUDA memory backend: the driver's virtual-memory API (cuda-python's ``cuda.bindings.driver``).

Same shape as :mod:`rollplex_trl.sharding.shm`, so the executor is backend-agnostic:

- an allocation is ``cuMemCreate`` physical memory exportable as a POSIX file descriptor, mapped whole into its own
  reserved range on its device;
- a peer opens it by name: the owner's small UNIX-socket server hands the descriptor over (``SCM_RIGHTS``), the peer
  imports it (``cuMemImportFromShareableHandle``) and maps it with access for its own device (NVLink P2P);
- a :class:`CudaRange` is ``cuMemAddressReserve`` + ``cuMemMap`` of granule-aligned pieces + ``cuMemSetAccess``.

Tensors over these addresses are built through ``__cuda_array_interface__`` (no copy). Not exercised on this
project's CPU-only machines; ``python -m rollplex_trl.sharding.gpu_check`` checks it on a GPU.
"""

from __future__ import annotations

import os
import socket
import threading

import torch

try:
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - cuda-python is a torch dependency on CUDA builds
    cu = None

_FD = None if cu is None else cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def _ok(result, what: str):
    err, *rest = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def _prop(device: int):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = _FD
    return prop


def granularity(device: int) -> int:
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(_ok(cu.cuMemGetAllocationGranularity(_prop(device), flag), "cuMemGetAllocationGranularity"))


def _access(ptr: int, nbytes: int, device: int) -> None:
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _ok(cu.cuMemSetAccess(ptr, nbytes, [desc], 1), "cuMemSetAccess")


class _ArrayInterface:
    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def tensor_at(ptr: int, nbytes: int, device: int) -> torch.Tensor:
    return torch.as_tensor(_ArrayInterface(ptr, nbytes), device=f"cuda:{device}")


def _socket_name(name: str) -> str:
    return "\0rollplex-vmm-" + name.strip("/").replace("/", "-")


class CudaFile:
    """A physical allocation, mapped whole on ``device``; peers open it by name (descriptor over a UNIX socket)."""

    def __init__(self, name: str, size: int, device: int, handle, owner: bool):
        self.name, self.size, self.device, self.handle, self.owner = name, size, device, handle, owner
        gran = granularity(device)
        self.addr = int(_ok(cu.cuMemAddressReserve(size, gran, 0, 0), "cuMemAddressReserve"))
        _ok(cu.cuMemMap(self.addr, size, 0, handle, 0), "cuMemMap")
        _access(self.addr, size, device)
        self._server: socket.socket | None = None

    @classmethod
    def create(cls, name: str, size: int, device: int) -> CudaFile:
        gran = granularity(device)
        size = max(gran, -(-size // gran) * gran)
        handle = _ok(cu.cuMemCreate(size, _prop(device), 0), "cuMemCreate")
        f = cls(name, size, device, handle, True)
        f._serve()
        return f

    @classmethod
    def open(cls, name: str, device: int) -> CudaFile:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(_socket_name(name))
            msg, fds, _, _ = socket.recv_fds(s, 64, 1)
        size = int(msg.decode())
        handle = _ok(cu.cuMemImportFromShareableHandle(fds[0], _FD), "cuMemImportFromShareableHandle")
        os.close(fds[0])
        return cls(name, size, device, handle, False)

    def _serve(self) -> None:
        fd = int(_ok(cu.cuMemExportToShareableHandle(self.handle, _FD, 0), "cuMemExportToShareableHandle"))
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(_socket_name(self.name))
        server.listen(64)
        self._server = server

        def loop():
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return  # closed
                with conn:
                    socket.send_fds(conn, [str(self.size).encode()], [fd])

        threading.Thread(target=loop, daemon=True).start()

    def bytes(self) -> torch.Tensor:
        return tensor_at(self.addr, self.size, self.device)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.addr:
            _ok(cu.cuMemUnmap(self.addr, self.size), "cuMemUnmap")
            _ok(cu.cuMemAddressFree(self.addr, self.size), "cuMemAddressFree")
            _ok(cu.cuMemRelease(self.handle), "cuMemRelease")
            self.addr = 0


class CudaRange:
    """A reserved device address range; pieces of allocations are mapped into it in any order."""

    def __init__(self, nbytes: int, device: int):
        self.device = device
        gran = granularity(device)
        self.size = max(gran, -(-nbytes // gran) * gran)
        self.addr = int(_ok(cu.cuMemAddressReserve(self.size, gran, 0, 0), "cuMemAddressReserve"))
        self._mapped: list[tuple[int, int]] = []

    def map(self, va: int, file: CudaFile, offset: int, nbytes: int) -> None:
        # A non-zero offset into the allocation is allowed by the CUDA 12/13 driver when granule-aligned.
        _ok(cu.cuMemMap(self.addr + va, nbytes, offset, file.handle, 0), "cuMemMap")
        _access(self.addr + va, nbytes, self.device)
        self._mapped.append((self.addr + va, nbytes))

    def bytes(self) -> torch.Tensor:
        return tensor_at(self.addr, self.size, self.device)

    def close(self) -> None:
        for ptr, n in self._mapped:
            _ok(cu.cuMemUnmap(ptr, n), "cuMemUnmap")
        if self.addr:
            _ok(cu.cuMemAddressFree(self.addr, self.size), "cuMemAddressFree")
            self.addr = 0

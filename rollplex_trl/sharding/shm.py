"""CPU memory backend: shared-memory files and page mappings (libc ``mmap`` through ctypes).

One virtual range is reserved per stitched tensor (``PROT_NONE``), then pages of shared-memory files are mapped into
it with ``MAP_FIXED`` in the rollout tensor's block order. Pages of the same file offset mapped in two places (or two
processes) are the same physical pages, so a write through the training tensor is visible through the rollout
tensor without any copy: the CPU tests check it byte for byte and read ``/proc/self/maps`` to show which file page
backs which address.
"""

from __future__ import annotations

import ctypes
import mmap as _mmap
import os
from dataclasses import dataclass

import torch

PAGE = _mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_NORESERVE = getattr(_mmap, "MAP_NORESERVE", 0x4000)
_MAP_FIXED = 0x10
_PROT_NONE = 0


def _check(addr: int | None, what: str) -> int:
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap failed ({what}): {os.strerror(err)}")
    return addr


def map_file(fd: int, nbytes: int, offset: int = 0, writable: bool = True, at: int | None = None) -> int:
    """Map ``nbytes`` of a file (shared); ``at``: replace the pages at that address (MAP_FIXED)."""
    prot = _mmap.PROT_READ | (_mmap.PROT_WRITE if writable else 0)
    flags = _mmap.MAP_SHARED | (_MAP_FIXED if at is not None else 0)
    return _check(_libc.mmap(at, nbytes, prot, flags, fd, offset), f"fd {fd} offset {offset} size {nbytes}")


def reserve(nbytes: int) -> int:
    """Reserve an address range (no memory behind it yet)."""
    flags = _mmap.MAP_PRIVATE | _mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    return _check(_libc.mmap(None, nbytes, _PROT_NONE, flags, -1, 0), f"reserve {nbytes}")


def unmap(addr: int, nbytes: int) -> None:
    if _libc.munmap(addr, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap failed: {os.strerror(err)}")


def tensor_at(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over raw memory (no copy). The memory must outlive it: the owner unmaps only on close()."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(addr), dtype=torch.uint8)


@dataclass
class SharedFile:
    """A shared-memory file mapped whole; other processes open it by path and map the same pages."""

    path: str
    fd: int
    size: int
    addr: int
    owner: bool

    @classmethod
    def create(cls, path: str, size: int) -> SharedFile:
        size = max(PAGE, -(-size // PAGE) * PAGE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)  # tmpfs: zero-filled, pages allocated on first touch
        return cls(path, fd, size, map_file(fd, size), True)

    @classmethod
    def open(cls, path: str, writable: bool = True) -> SharedFile:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        size = os.fstat(fd).st_size
        return cls(path, fd, size, map_file(fd, size, writable=writable), False)

    def bytes(self) -> torch.Tensor:
        return tensor_at(self.addr, self.size)

    def unlink(self) -> None:
        """Remove the file's name now (every process that needs it has it open or mapped): its pages live until
        the last mapping goes, and a crash leaves nothing behind in /dev/shm."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.owner = False  # close() has nothing left to unlink

    def close(self, unlink: bool | None = None) -> None:
        if self.fd < 0:
            return
        unmap(self.addr, self.size)
        os.close(self.fd)
        self.fd = -1
        if self.owner if unlink is None else unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class VirtualRange:
    """A reserved address range that pages of shared files are mapped into, in any order."""

    def __init__(self, nbytes: int):
        self.size = max(PAGE, -(-nbytes // PAGE) * PAGE)
        self.addr = reserve(self.size)

    def map(self, va: int, file: SharedFile, offset: int, nbytes: int) -> None:
        if va % PAGE or offset % PAGE or va + nbytes > self.size:
            raise ValueError(f"unaligned or out-of-range mapping: va={va} offset={offset} size={nbytes}")
        map_file(file.fd, nbytes, offset, at=self.addr + va)

    def bytes(self) -> torch.Tensor:
        return tensor_at(self.addr, self.size)

    def close(self) -> None:
        if self.addr:
            unmap(self.addr, self.size)
            self.addr = 0


def backing_of(addr: int) -> tuple[str, int] | None:
    """(file path, file offset) of the page at ``addr`` in this process, read from /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                path = parts[5] if len(parts) > 5 else ""
                return path, int(parts[2], 16) + (addr - lo)
    return None

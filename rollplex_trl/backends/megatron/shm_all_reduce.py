"""The tensor-parallel all-reduce through shared memory, for a CPU TP group whose ranks share one host.

Why: at t > 1 every decoder layer all-reduces its row-parallel outputs in the forward and its column-parallel input
gradients in the backward (about 100 all-reduces per step on the `small` preset, 50 MB). Over gloo each costs a
TCP round trip through the loopback: 0.85 ms for 16 KiB, 1.9 ms for 0.8 MiB on the 2-core machine, about 0.18 s
of a 1.5 s step. Through one shared-memory file the same sums take 0.03-0.3 ms (6-25x less; measured with
torch.distributed.run, two processes, one thread each).

How: the file holds a control page (one sequence number per rank, each on its own cache line) and two banks of
one slot per rank (``slot_bytes`` each). Call n writes the rank's tensor (a chunk of it, for tensors larger than a
slot) into its slot of bank n % 2, publishes n, waits until every rank has published n, then sums the slots in
rank order into the tensor. Before writing bank n % 2 again (call n + 2) a rank waits until every rank has
published n + 1, i.e. finished reading call n: two banks make one wait per call instead of two barriers.

Exactness: every rank adds the same slots in the same order (rank 0 + rank 1 + ...), so the result is identical on
every rank (the replicated activations of a TP group stay identical); with two ranks it is also gloo's sum bit for
bit (a + b = b + a in IEEE arithmetic), with more it can differ from gloo's order in the last bits.

Memory ordering (x86 only): the protocol has no fences or atomics. A writer copies its chunk into its slot, then
stores its sequence number with a plain store; a reader loads the peers' numbers, then reads their slots. This is
correct only where the hardware keeps stores in program order as other cores see them, and loads in program order
(x86's total store order; torch's intra-op threads, which may do the copy, join through a lock before the store).
ARM and POWER may make the number visible before the data, or satisfy the slot read before the number's load: a
reader could then sum stale bytes with no error. So `rollplex_shm_all_reduce="auto"` takes gloo on any machine that
is not x86 (`store_order_reason`), and `"on"` there is refused at construction (a ValueError); a port would need
release/acquire ordering on the sequence numbers (e.g. C11 atomics), which torch's Python API does not expose.

A rank that never arrives (its process died) turns into a RuntimeError after ``timeout_s`` naming the call, not a
hang. The file is unlinked as soon as every rank has it mapped: nothing is left in /dev/shm after a crash.

Installed by `megatron_compat.route_tensor_parallel_all_reduce` (megatron-core's `_reduce` for this group).
"""

from __future__ import annotations

import os
import platform
import time
import uuid

import torch
import torch.distributed as dist

from rollplex_trl.sharding.shm import SharedFile

SHM_ROOT = "/dev/shm"
CONTROL_BYTES = 4096
LINE = 64  # bytes between two ranks' sequence numbers (one cache line each)
DEFAULT_SLOT_BYTES = 4 << 20
DEFAULT_TIMEOUT_S = 1800.0  # torch.distributed's default process-group timeout
# platform.machine() of the x86 family (Linux, macOS, Windows spellings): total store order, see the module docstring
X86_MACHINES = frozenset({"x86_64", "amd64", "x64", "i386", "i486", "i586", "i686", "x86"})


def store_order_reason(machine: str | None = None) -> str | None:
    """Why this machine's memory model does not give the protocol the store/load order it relies on (None: an x86
    machine, which does). ``machine``: platform.machine() unless given."""
    machine = platform.machine() if machine is None else machine
    if machine.lower() in X86_MACHINES:
        return None
    return (f"this machine is {machine or 'of an unknown type'!s}, not x86: the shared-memory all-reduce publishes "
            "its data with plain stores and relies on x86's store order, which this CPU does not guarantee")


def shm_all_reduce_reason(device: torch.device, tp_group: dist.ProcessGroup | None, tp_size: int,
                          slot_bytes: int = DEFAULT_SLOT_BYTES) -> str | None:
    """Why the shared-memory all-reduce cannot run for this TP group (None: it can), the same answer on every
    rank of the group (a collective: call on all of them)."""
    local = None
    if tp_size == 1:
        return "t = 1 (no tensor-parallel all-reduce)"
    if device.type != "cpu":
        local = f"the training device is {device.type} (NCCL does these all-reduces there)"
    elif (order := store_order_reason()) is not None:
        local = order
    elif not os.path.isdir(SHM_ROOT):
        local = f"{SHM_ROOT} does not exist"
    else:
        stat = os.statvfs(SHM_ROOT)
        need = _file_bytes(tp_size, slot_bytes)
        if stat.f_bavail * stat.f_frsize < 4 * need:
            local = f"{SHM_ROOT} has less than {4 * need / 2**20:.0f} MiB free"
    from rollplex_trl.backends.megatron.mapped_weights import agree

    return agree(local, tp_group, tp_size)  # one answer for the group: the first reason, or several hosts


def refuse_unordered_machine(machine: str | None = None) -> None:
    """Raise the ValueError of `rollplex_shm_all_reduce="on"` on a machine that is not x86 (the same answer on
    every rank of a TP group, which shares one host)."""
    reason = store_order_reason(machine)
    if reason is not None:
        raise ValueError(f"rollplex_shm_all_reduce='on' cannot run here: {reason} (a peer could read a slot before "
                         "its data lands, summing stale bytes silently); use rollplex_shm_all_reduce='auto' or "
                         "'off' (the TP all-reduces then go through gloo)")


def _file_bytes(size: int, slot_bytes: int) -> int:
    return CONTROL_BYTES + 2 * size * slot_bytes


class SharedMemoryAllReduce:
    """In-place sum over the ranks of ``group`` through one shared-memory file (see the module docstring).

    Construct on every rank of the group together (it broadcasts the file name and barriers). ``__call__`` takes
    a contiguous CPU tensor and returns it, summed; call it on every rank in the same order, as any collective.
    Refused (ValueError, before any collective) on a machine that is not x86 (`store_order_reason`).
    """

    def __init__(self, group: dist.ProcessGroup | None, *, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        refuse_unordered_machine()
        if slot_bytes % LINE:
            raise ValueError(f"slot_bytes={slot_bytes} must be a multiple of {LINE}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.size * LINE > CONTROL_BYTES:
            raise ValueError(f"a TP group of {self.size} ranks does not fit the control page")
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        name = [f"{SHM_ROOT}/rollplex-tp-allreduce-{uuid.uuid4().hex}" if self.rank == 0 else None]
        dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
        self.file = SharedFile.create(name[0], _file_bytes(self.size, slot_bytes)) if self.rank == 0 else None
        dist.barrier(group=group)
        if self.file is None:
            self.file = SharedFile.open(name[0])
        dist.barrier(group=group)  # every rank has it mapped
        if self.rank == 0:
            self.file.unlink()
        raw = self.file.bytes()
        self._control = raw[:CONTROL_BYTES].view(torch.int64)  # rank r's sequence number at [r * LINE / 8]
        self._banks = raw[CONTROL_BYTES:].view(2, self.size, slot_bytes)
        self._seq = 0
        self.calls = 0
        self.bytes = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.view(-1).view(torch.uint8)
        step = self.slot_bytes - self.slot_bytes % tensor.element_size()
        for start in range(0, flat.numel(), step):
            self._reduce_chunk(flat[start:start + step].view(tensor.dtype))
        self.calls += 1
        self.bytes += flat.numel()
        return tensor

    def _reduce_chunk(self, chunk: torch.Tensor) -> None:
        self._seq += 1
        seq, nbytes = self._seq, chunk.numel() * chunk.element_size()
        self._wait(seq - 1)  # every rank is done reading the bank written two calls ago
        bank = self._banks[seq % 2]
        bank[self.rank, :nbytes].view(chunk.dtype).copy_(chunk)
        self._control[self.rank * (LINE // 8)] = seq  # published after the data (see the module docstring)
        self._wait(seq)
        chunk.copy_(bank[0, :nbytes].view(chunk.dtype))
        for r in range(1, self.size):
            chunk.add_(bank[r, :nbytes].view(chunk.dtype))

    def _wait(self, seq: int) -> None:
        control, stride = self._control, LINE // 8
        spins, start = 0, None
        while any(int(control[r * stride]) < seq for r in range(self.size)):
            spins += 1
            if spins < 2000:
                os.sched_yield()  # the peer is usually a few microseconds away
                continue
            start = start or time.monotonic()
            if time.monotonic() - start > self.timeout_s:
                behind = [r for r in range(self.size) if int(control[r * stride]) < seq]
                raise RuntimeError(f"shared-memory all-reduce call {seq}: TP ranks {behind} did not arrive within "
                                   f"{self.timeout_s:.0f} s (a peer process died or stopped calling collectives)")
            time.sleep(50e-6)  # a long wait (the peer is computing): do not take its core

    def close(self) -> None:
        if self.file is not None:
            self.file.close(unlink=False)
            self.file = None

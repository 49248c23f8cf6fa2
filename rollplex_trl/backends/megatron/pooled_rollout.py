"""The transformers rollout once per tensor-parallel group, on its first rank, with the whole group's CPU threads.

Why: every TP rank holds the whole transformers rollout model (its tensors mapped onto the shards), and the group
trains on the first rank's completions (`MegatronBackend.share_completions`). Decoding the same batch on every
rank, each with its own intra-op threads, spends t times the work for one result; on one host the ranks' cores can
serve the one rollout instead. Measured on the 2-core machine at t = 2 (one thread per rank): prefill + decode
0.47 s per step on every rank vs 0.25 s on the first rank with both threads (the `hf` backend's time in one process).

How: the first rank raises its intra-op thread count to the group's (``threads x t``, at most the cores it may
run on) for the rollout; the peers wait on a shared-memory counter, polling with a sleep so their cores stay free.
The rollout's decode window (rollplex_overlap, serial on CPU) runs its prefix jobs on every rank: TP collectives,
so the first rank drops back to its own thread count and posts the counter when decoding ends, and the peers,
which opened the same window, run the same jobs then. The completions and the first rank's RNG state (the
sampling drew from it; TRL shuffles the batch with it next) are broadcast to the peers afterwards.

Same completions as every rank decoding (the first rank's), up to the last bits a different thread count gives the
logits. Where it does not apply (a GPU, several hosts, the vLLM engine, the concurrent overlap schedule, which
decodes and runs the jobs at once and would oversubscribe the cores) every rank decodes, as before.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from rollplex_trl.sharding.shm import SharedFile

SHM_ROOT = "/dev/shm"
POLL_S = 1e-3  # the peers' poll interval while the first rank decodes (a wake-up per ms: no core taken)
DEFAULT_TIMEOUT_S = 1800.0


def pooled_rollout_reason(device: torch.device, tp_group: dist.ProcessGroup | None, tp_size: int, *,
                          use_vllm: bool, overlap: str) -> str | None:
    """Why the rollout cannot be pooled on the first TP rank (None: it can); the same answer on every rank of the
    group (a collective at t > 1: call it on all of them)."""
    if tp_size == 1:
        return "t = 1"
    local = None
    if device.type != "cpu":
        local = f"the rollout runs on {device.type} (each rank has its own device)"
    elif use_vllm:
        local = "use_vllm=True (each rank's vLLM engine generates)"
    elif overlap == "on":
        local = "rollplex_overlap='on' decodes while the prefix jobs run (the cores are taken)"
    elif not os.path.isdir(SHM_ROOT):
        local = f"{SHM_ROOT} does not exist"
    from rollplex_trl.backends.megatron.mapped_weights import agree

    return agree(local, tp_group, tp_size)  # one answer for the group: the first reason, or several hosts


class PooledRollout:
    """The first TP rank's rollout with the group's threads; the peers' wait (see the module docstring).

    Construct on every rank of the group together (it broadcasts a file name and barriers)."""

    def __init__(self, tp_group: dist.ProcessGroup | None, tp_rank: int, tp_size: int, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.tp_group, self.tp_rank, self.tp_size = tp_group, tp_rank, tp_size
        self.timeout_s = timeout_s
        name = [f"{SHM_ROOT}/rollplex-rollout-{uuid.uuid4().hex}" if tp_rank == 0 else None]
        src = dist.get_global_rank(tp_group, 0) if tp_group is not None else 0
        dist.broadcast_object_list(name, src=src, group=tp_group)
        self._file = SharedFile.create(name[0], 64) if tp_rank == 0 else None
        dist.barrier(group=tp_group)
        if self._file is None:
            self._file = SharedFile.open(name[0])
        dist.barrier(group=tp_group)
        if tp_rank == 0:
            self._file.unlink()
        self._counter = self._file.bytes()[:8].view(torch.int64)  # rollouts the first rank has finished decoding
        self._rollouts = 0
        self._posted = False
        self.own_threads = torch.get_num_threads()
        self.pooled_threads = min(self.own_threads * tp_size, len(os.sched_getaffinity(0)))

    @property
    def decodes(self) -> bool:
        """Whether this rank runs the rollout (the TP group's first rank)."""
        return self.tp_rank == 0

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """The first rank's rollout: with the group's threads; the peers released when it ends (if the decode
        window has not released them already)."""
        self._rollouts += 1
        self._posted = False
        self.own_threads = torch.get_num_threads()
        try:
            with _threads(self.pooled_threads):
                yield
        finally:
            self._post()

    def window(self, factory: Callable | None) -> Callable | None:
        """The first rank's decode window: the decode with the group's threads, the window's prefix jobs (TP
        collectives) with its own, after releasing the peers, which run the same jobs."""
        if factory is None:
            return None

        @contextlib.contextmanager
        def pooled(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Iterator[None]:
            # the window is entered and its jobs run (after the decode) with this rank's own threads, the decode
            # inside it with the group's; generate resumes with the group's (decoding() restores them)
            with _threads(self.own_threads), factory(input_ids, attention_mask):
                try:
                    with _threads(self.pooled_threads):
                        yield
                finally:
                    self._post()

        return pooled

    def with_own_threads(self) -> contextlib.AbstractContextManager:
        """Within the first rank's `decoding()`: its own thread count for a TP collective (the peers run theirs)."""
        return _threads(self.own_threads)

    def wait(self) -> None:
        """A peer: until the first rank's decode of this rollout is done (no collective: the window's jobs may be
        the next TP collectives)."""
        self._rollouts += 1
        start = time.monotonic()
        while int(self._counter[0]) < self._rollouts:
            if time.monotonic() - start > self.timeout_s:
                raise RuntimeError(f"pooled rollout {self._rollouts}: the TP group's first rank did not finish "
                                   f"decoding within {self.timeout_s:.0f} s (it died or stopped)")
            time.sleep(POLL_S)

    def _post(self) -> None:
        if not self._posted:
            self._counter[0] = self._rollouts
            self._posted = True

    def close(self) -> None:
        if self._file is not None:
            self._file.close(unlink=False)
            self._file = None


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` within the block, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

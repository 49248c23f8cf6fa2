"""Gradient reduction for the Megatron backend: data-parallel averaging and a tensor-parallel-aware norm clip.

Within a TP group, a parameter megatron marks ``tensor_model_parallel=True`` holds a different shard on every rank
(except rows ``MegatronPolicy.duplicate_rows`` names: KV groups replicated over ranks); every other
parameter (norms, biases of row-parallel layers, the replicated vision tower) is replicated and, after
Megatron's own all-reduces in backward, has the same gradient on every rank of the group; with the vision tower's
items split over the TP ranks (rollplex_split_vision) its gradients are summed over TP first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from rollplex_trl.backends.megatron.parallel import ParallelGroups

BUCKET_BYTES = 64 << 20
# elements per fp32 partial sum of the norm: torch's fp32 vector_norm of one long CPU tensor accumulates with an
# error that grows with its length (relative to an fp64 sum, measured: 3e-6 at 1M elements, 2.5e-4 at 16M, 2.6e-3
# at 64M; bf16 values, whose squares round alike, bias it further), so a tensor's squares are summed in rows of
# this many elements and the rows added in fp64 (1e-9 at 16M fp32 elements, 1e-8 for bf16 values; as fast)
NORM_ROW = 256


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Gradients grouped by dtype, each group cut into buckets of about ``bucket_bytes``."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    out = []
    for same in by_dtype.values():
        bucket, size = [], 0
        for g in same:
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= bucket_bytes:
                out.append(bucket)
                bucket, size = [], 0
        if bucket:
            out.append(bucket)
    return out


def _in_flat_buckets(grads: list[torch.Tensor], collective: Callable[[torch.Tensor], object],
                     bucket_bytes: int) -> None:
    """Run an in-place ``collective`` on the gradients, one flattened bucket at a time, and write the result back."""
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        collective(flat)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def average_data_parallel_gradients(params: Iterable[torch.nn.Parameter], groups: ParallelGroups,
                                    bucket_bytes: int = BUCKET_BYTES) -> None:
    """Replace every gradient by its mean over the data-parallel group (one all-reduce per flattened bucket).

    Parameters without a gradient are skipped, so every DP rank must have gradients for the same parameters.
    """
    if groups.dp_size == 1:
        return
    def average(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=groups.dp_group)
        flat /= groups.dp_size

    _in_flat_buckets([p.grad for p in params if p.grad is not None], average, bucket_bytes)


@torch.no_grad()
def share_replicated_gradients(params: Iterable[torch.nn.Parameter], groups: ParallelGroups,
                               bucket_bytes: int = BUCKET_BYTES) -> None:
    """Give every TP rank the group's first rank's gradients of the replicated parameters (norms, row-parallel
    biases, the replicated vision tower), one broadcast per flattened bucket.

    They are equal in exact arithmetic, but a kernel whose rounding depends on scheduling or memory layout
    (cuDNN's convolution backward, atomics) can make them differ in the last bits on different ranks; AdamW then
    turns that into different replicas, which drift apart over a run and feed the TP layers different inputs. After
    this every replica takes the same step, bit for bit. Call once per optimizer step, before clipping.
    """
    if groups.tp_size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None and not getattr(p, "tensor_model_parallel", False)]
    source = dist.get_global_rank(groups.tp_group, 0)
    _in_flat_buckets(grads, lambda flat: dist.broadcast(flat, src=source, group=groups.tp_group), bucket_bytes)


@torch.no_grad()
def sum_vision_gradients(params: Iterable[torch.nn.Parameter], groups: ParallelGroups,
                         all_reduce: Callable[[torch.Tensor], torch.Tensor],
                         bucket_bytes: int = BUCKET_BYTES) -> None:
    """Add the vision tower's gradients over the TP group, where each rank's hold only its own items'
    contributions (rollplex_split_vision, vision_split.py); ``all_reduce`` is the group's in-place sum. A parameter
    no rank has a gradient for keeps none (as with the replicated tower: AdamW skips it); one that only some ranks
    have gets zeros on the others first. Call once per optimizer step, before the replicated gradients are shared."""
    params = list(params)
    if groups.tp_size == 1 or not params:
        return
    present = torch.tensor([float(p.grad is not None) for p in params])
    dist.all_reduce(present, group=groups.tp_group)
    summed = [p for p, n in zip(params, present.tolist()) if n > 0]
    for p in summed:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    _in_flat_buckets([p.grad for p in summed], all_reduce, bucket_bytes)


def sum_of_squares(grad: torch.Tensor) -> torch.Tensor:
    """The sum of the squares of ``grad``'s elements as an fp64 scalar: fp32 partial sums over rows of `NORM_ROW`
    elements (one reduction kernel over a 2-D view, no fp64 copy of the tensor), added in fp64."""
    flat = grad.detach().reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.float()
    whole = flat.numel() - flat.numel() % NORM_ROW
    parts = [torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), dim=1)] if whole else []
    parts.append(torch.linalg.vector_norm(flat[whole:]).reshape(1))
    return sum((part.double() ** 2).sum() for part in parts)


@torch.no_grad()
def clip_grad_norm_tensor_parallel(params: Iterable[torch.nn.Parameter], max_norm: float | None,
                                   groups: ParallelGroups,
                                   duplicate_rows: Mapping[torch.nn.Parameter, torch.Tensor] | None = None
                                   ) -> torch.Tensor:
    """The global L2 norm of the gradients of the whole (unsharded) model, and clip to ``max_norm`` like
    ``torch.nn.utils.clip_grad_norm_`` (``max_norm`` None or 0: measure only). Same result on every rank.
    `duplicate_rows`: for a sharded parameter, the rows a lower TP rank holds too (`MegatronPolicy.duplicate_rows`),
    counted once.

    Accumulated in fp64 (`sum_of_squares`): a long tensor's fp32 norm is off by up to 1e-4-1e-3 relative on CPU,
    by an amount that depends on how the tensor is cut (TP shards vs the whole HF tensor), and the clip scales the
    update by it. Returned in fp32, as torch's."""
    sharded, replicated, counted = [], [], []
    for p in params:
        if p.grad is None:
            continue
        if getattr(p, "tensor_model_parallel", False):
            sharded.append(p.grad)
            dup = (duplicate_rows or {}).get(p)
            counted.append(p.grad if dup is None else p.grad[~dup.to(p.grad.device)])
        else:
            replicated.append(p.grad)
    device = (sharded or replicated)[0].device if (sharded or replicated) else torch.device("cpu")

    def sq(grads):
        return sum((sum_of_squares(g) for g in grads), torch.zeros((), dtype=torch.float64, device=device))

    total = sq(counted)
    if groups.tp_size > 1:
        dist.all_reduce(total, group=groups.tp_group)
    norm = (total + sq(replicated)).sqrt().float()
    if max_norm:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in sharded + replicated:
            g.mul_(coef.to(g.dtype))
    return norm

"""Per-token log-probabilities and entropies over vocabulary-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a contiguous slice of the vocabulary (rank k: ``[k * V/t, (k + 1) * V/t)``, Megatron's
``VocabParallelEmbedding`` / ``ColumnParallelLinear`` split). Four all-reduces over the TP group give exactly what
``torch.log_softmax(full_logits / T)`` gives: the max (for stability), the sum of exponentials, the target's logit,
and, for the entropy, the sum of ``p * logit``. Everything is computed in fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelLogps(torch.autograd.Function):
    """logp[n] = x[n, target[n]] - lse[n]; H[n] = lse[n] - sum_j p[n, j] x[n, j]; x = logits / T (fp32).

    Backward is local to the shard: d logp / dx = onehot - p, dH / dx = -p (log p + H); the input-gradient
    all-reduce of the output layer (Megatron's ColumnParallelLinear) combines the shards."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, group, compute_entropy):
        with torch.autocast(device_type=logits.device.type, enabled=False):
            x = logits.float() / temperature
            vocab_local = x.shape[-1]
            rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
            start = rank * vocab_local
            local_t = targets - start
            inside = (local_t >= 0) & (local_t < vocab_local)
            local_t = local_t.clamp(0, vocab_local - 1)

            m = _all_reduce(x.max(dim=-1).values, group, dist.ReduceOp.MAX)
            shifted = x - m.unsqueeze(-1)
            e = shifted.exp()
            sums = [e.sum(-1), shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside]
            if compute_entropy:
                sums.append((e * shifted).sum(-1))
            total = _all_reduce(torch.stack(sums), group)  # one collective for the three sums
            s, target = total[0], total[1]
            log_s = s.log()
            logp = target - log_s
            entropy = log_s - total[2] / s if compute_entropy else None
        ctx.save_for_backward(shifted, log_s, local_t, inside, entropy if compute_entropy else log_s)
        ctx.temperature, ctx.compute_entropy, ctx.in_dtype = temperature, compute_entropy, logits.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        shifted, log_s, local_t, inside, entropy = ctx.saved_tensors
        with torch.autocast(device_type=shifted.device.type, enabled=False):
            logp_all = shifted - log_s.unsqueeze(-1)
            p = logp_all.exp()
            grad = -p * grad_logp.unsqueeze(-1) if grad_logp is not None else torch.zeros_like(p)
            if grad_logp is not None:
                grad.scatter_add_(-1, local_t.unsqueeze(-1), (grad_logp * inside).unsqueeze(-1))
            if ctx.compute_entropy and grad_entropy is not None:
                grad -= p * (logp_all + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
            grad = grad / ctx.temperature
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_logps(logits_shard: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                         tp_group: dist.ProcessGroup | None, compute_entropy: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(full_logits / temperature)`` at ``targets`` (and the entropy) from this rank's vocabulary shard.

    ``logits_shard``: ``[..., V/t]`` (any float dtype); ``targets``: ``[...]`` token ids in the full vocabulary.
    Differentiable with respect to ``logits_shard``. ``tp_group=None`` means an unsplit vocabulary. Returns fp32.
    """
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} and targets {tuple(targets.shape)} do not match")
    logp, entropy = _VocabParallelLogps.apply(logits_shard, targets.long(), float(temperature), tp_group,
                                              bool(compute_entropy))
    return logp, entropy

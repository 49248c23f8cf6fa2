"""Cascade (shared-prefix) attention: attention over [prompt K/V, own K/V] without copying the prompt per row.

R query rows continue U prompts (row r continues prompt `row_to_prompt[r]`; in GRPO, U prompts x G completions).
Plain attention would attend row r to `cat(prefix_k[row_to_prompt[r]], suffix_k[r])`, which needs the prompt's K/V
once per row (G copies, and G reads of it per decode step). Here attention is split in two and merged exactly:

    prefix part  one batched matmul per prompt: the queries of all its rows (and, under GQA, of all query heads of a
                 KV head) against the prompt's K/V, read once;
    suffix part  each row against its own K/V;
    merge        softmax over the union of keys = the two partial softmaxes reweighted by their log-sum-exps:
                 out = exp(lse_p - lse) * out_p + exp(lse_s - lse) * out_s,  lse = logaddexp(lse_p, lse_s).

The merge is the identity softmax(x ++ y) = [e^x, e^y] / (sum e^x + sum e^y), so the result equals plain attention
on the concatenation up to float rounding (tested at 1e-6 in fp32). Scores are computed in the inputs' dtype and the
softmax statistics in fp32, like transformers' eager attention.

Used by shared-prefix decoding (prefix/shared_decode.py) and written for any number of query tokens per row, so the
scoring passes can use it as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollplex_trl.torch_compat import cpu_flash_attention, cpu_flash_attention_backward

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowGroups:
    """Where each prompt's rows are: the layout the prefix part batches its queries in.

    rows: (U, Gmax) row indices of each prompt's rows (batch order kept; padded slots repeat row 0, which may
        belong to another prompt or, for a prompt with no rows, to none: their results are dropped, and the
        backward gives them no weight);
    valid: (U, Gmax) which slots are real, None when every prompt has Gmax rows;
    inverse: (R,) the slot of each row in the flattened (U*Gmax) layout;
    contiguous: rows are already [prompt 0's G rows, prompt 1's G rows, ...] (TRL's order): no gather needed.
    Computing it reads row counts on the host, so a decode loop builds it once (`group_rows`), not per layer.
    """

    rows: torch.Tensor
    valid: torch.Tensor | None
    inverse: torch.Tensor
    contiguous: bool


def group_rows(row_to_prompt: torch.Tensor, num_prompts: int) -> RowGroups:
    """The `RowGroups` of a row -> prompt index (any order, any number of rows per prompt)."""
    row_to_prompt = row_to_prompt.long()
    R = row_to_prompt.numel()
    counts = torch.bincount(row_to_prompt, minlength=num_prompts)
    order = torch.argsort(row_to_prompt, stable=True)
    g_max = int(counts.max()) if counts.numel() else 0
    if bool((counts == g_max).all()):
        rows = order.view(num_prompts, g_max)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(R, device=order.device)
        contiguous = bool(torch.equal(order, torch.arange(R, device=order.device)))
        return RowGroups(rows, None, inverse, contiguous)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(g_max, device=row_to_prompt.device)
    valid = slot.unsqueeze(0) < counts.unsqueeze(1)  # (U, Gmax)
    index = (starts.unsqueeze(1) + slot).clamp(max=max(R - 1, 0))
    rows = order[index].masked_fill(~valid, 0)
    slots = torch.nonzero(valid.reshape(-1))[:, 0]
    inverse = torch.empty(R, dtype=torch.long, device=row_to_prompt.device)
    inverse[rows.reshape(-1)[slots]] = slots
    return RowGroups(rows, valid, inverse, False)


def _partial(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-weighted values and the log-sum-exp of masked fp32 scores (-inf = masked). A fully masked row gives
    output 0 and lse -inf, which the merge then weighs 0."""
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0))  # exp(-inf) = 0 for masked keys
    return torch.matmul(weights.to(values.dtype), values), lse


def _partial_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, keep: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`_partial` in one fused CPU kernel (PyTorch's CPU flash attention, which also returns the log-sum-exp):
    no score matrix in memory, one pass over the keys. A fully masked row comes back as lse 0 and output 0 from
    the kernel; its lse is set to -inf here so the merge weighs it 0, as in `_partial`."""
    bias = None
    if keep is not None:
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, NEG_INF)
    out, lse = cpu_flash_attention(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    lse = lse.unsqueeze(-1)
    if keep is not None:
        lse = lse.masked_fill(~keep.any(-1, keepdim=True), NEG_INF)
    return out, lse


def _use_fused(impl: str, *tensors: torch.Tensor) -> bool:
    if impl not in ("auto", "math", "fused"):
        raise ValueError(f"impl must be 'auto', 'math' or 'fused', got {impl!r}")
    if impl != "auto":
        return impl == "fused"
    # auto: the fused CPU kernel for inference (decoding); the plain ops where gradients flow (their backward is
    # plain autograd) and off CPU (a fused kernel with log-sum-exp on CUDA is not wired here yet). Under no_grad a
    # graph-carrying input (the rollout's prefill kept for the actor window) records nothing: fused too.
    flows = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return not flows and all(t.device.type == "cpu" for t in tensors)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics in fp32 at least (fp64 inputs keep fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, keep: torch.Tensor | None) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)).to(_stat_dtype(q.dtype)) * scale
    return scores if keep is None else scores.masked_fill(~keep, NEG_INF)


def cascade_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_mask: torch.Tensor | None,
    row_to_prompt: torch.Tensor,
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    suffix_mask: torch.Tensor | None,
    scale: float,
    groups: RowGroups | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Attention of R rows over their prompt's K/V followed by their own K/V, the prompt's K/V never copied per row.

    Args:
        q: (R, H, Q, D) queries, Q tokens per row (1 when decoding).
        prefix_k, prefix_v: (U, Hkv, P, D) the prompts' keys/values; H must be a multiple of Hkv (GQA).
        prefix_mask: (U, P) bool/0-1, True = attend (a prompt's left padding is False), or None (all attended).
            It is per prompt: the same for all rows of a prompt and all their query tokens.
        row_to_prompt: (R,) long, the prompt each row continues.
        suffix_k, suffix_v: (R, Hkv, S, D) each row's own keys/values (S may be 0).
        suffix_mask: bool, broadcastable to (R, 1, Q, S), True = attend (causality inside the suffix goes here),
            or None (all attended).
        scale: the softmax scale (usually D ** -0.5).
        groups: `group_rows(row_to_prompt, U)`, precomputed (a decode loop calls this for every layer and step);
            computed here if None.
        impl: "math" (matmuls, softmax statistics in fp32, differentiable), "fused" (PyTorch's fused CPU flash
            kernel for each part; CPU only), or "auto" (fused on CPU without gradients, else math).

    Returns:
        (R, H, Q, D) in q's dtype: what softmax attention over `cat(prefix[row_to_prompt], suffix)` gives.
    """
    R, H, Q, D = q.shape
    U, Hkv, P, _ = prefix_k.shape
    if H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} key/value heads")
    rep = H // Hkv

    # Prefix part: the queries of a prompt's rows (all G rows x rep heads x Q tokens) as one matrix per KV head
    groups = groups if groups is not None else group_rows(row_to_prompt, U)
    g_max = groups.rows.size(1)
    grouped = q if groups.contiguous else q.index_select(0, groups.rows.reshape(-1))
    grouped = grouped.reshape(U, g_max, Hkv, rep, Q, D).transpose(1, 2).reshape(U, Hkv, g_max * rep * Q, D)
    keep_p = None if prefix_mask is None else prefix_mask.bool().view(U, 1, 1, P)
    fused = _use_fused(impl, q, prefix_k, prefix_v, suffix_k, suffix_v)
    if fused:
        out_p, lse_p = _partial_fused(grouped, prefix_k, prefix_v, scale, keep_p)
    else:
        out_p, lse_p = _partial(_scores(grouped, prefix_k, scale, keep_p), prefix_v)  # (U, Hkv, Gmax*rep*Q, D|1)
    # back to rows: (U, Hkv, Gmax, rep, Q, .) -> (U*Gmax, H, Q, .), then each row's slot
    out_p = out_p.reshape(U, Hkv, g_max, rep, Q, D).transpose(1, 2).reshape(U * g_max, H, Q, D)
    lse_p = lse_p.reshape(U, Hkv, g_max, rep, Q, 1).transpose(1, 2).reshape(U * g_max, H, Q, 1)
    if not groups.contiguous:
        out_p, lse_p = out_p.index_select(0, groups.inverse), lse_p.index_select(0, groups.inverse)

    if suffix_k.size(-2) == 0:
        return out_p.to(q.dtype)

    # Suffix part: each row against its own keys (GQA: the rep query heads of a KV head as extra query rows)
    S = suffix_k.size(-2)
    q_rows = q.reshape(R, Hkv, rep * Q, D)
    keep_s = None
    if suffix_mask is not None:
        keep_s = suffix_mask.bool().expand(R, 1, Q, S).unsqueeze(2).expand(R, 1, rep, Q, S).reshape(R, 1, rep * Q, S)
    if fused:
        out_s, lse_s = _partial_fused(q_rows, suffix_k, suffix_v, scale, keep_s)
    else:
        out_s, lse_s = _partial(_scores(q_rows, suffix_k, scale, keep_s), suffix_v)
    out_s, lse_s = out_s.reshape(R, H, Q, D), lse_s.reshape(R, H, Q, 1)

    # Merge: the softmax over both key sets, from the two partial ones
    lse = torch.logaddexp(lse_p, lse_s)
    safe = lse.nan_to_num(neginf=0.0)  # a query that attends to nothing at all gets 0, not NaN
    stat = _stat_dtype(q.dtype)
    out = torch.exp(lse_p - safe) * out_p.to(stat) + torch.exp(lse_s - safe) * out_s.to(stat)
    return out.to(q.dtype)


def reference_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_mask: torch.Tensor | None,
    row_to_prompt: torch.Tensor,
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    suffix_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The same attention done plainly: the prompt's K/V copied to every row and concatenated with the row's own
    (what the expanded cache does). For tests and as the definition `cascade_attention` must match."""
    R, H, Q, _ = q.shape
    rows = row_to_prompt.to(device=q.device, dtype=torch.long)
    keys = torch.cat([prefix_k.index_select(0, rows), suffix_k], dim=-2)
    values = torch.cat([prefix_v.index_select(0, rows), suffix_v], dim=-2)
    rep = H // keys.size(1)
    keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
    P, S = prefix_k.size(-2), suffix_k.size(-2)
    keep_p = (torch.ones(R, P, dtype=torch.bool, device=q.device) if prefix_mask is None
              else prefix_mask.bool().index_select(0, rows))
    keep_p = keep_p.view(R, 1, 1, P).expand(R, 1, Q, P)
    keep_s = (torch.ones(R, 1, Q, S, dtype=torch.bool, device=q.device) if suffix_mask is None
              else suffix_mask.bool().expand(R, 1, Q, S))
    keep = torch.cat([keep_p, keep_s], dim=-1)
    scores = (torch.matmul(q, keys.transpose(-1, -2)).to(_stat_dtype(q.dtype)) * scale).masked_fill(~keep, NEG_INF)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(weights.to(values.dtype), values).to(q.dtype)


# ----------------------------------------------------------------------------------------------------------------
# The scoring passes: differentiable cascade attention on PyTorch's fused CPU kernels
# ----------------------------------------------------------------------------------------------------------------

_flash = cpu_flash_attention
_flash_backward = cpu_flash_attention_backward


def _to_prompt_major(x: torch.Tensor, groups: RowGroups, hkv: int) -> torch.Tensor:
    """(R, H, Q, .) rows -> (U, Hkv, Gmax*rep*Q, .): a prompt's rows (and a KV head's query heads) as one matrix."""
    R, H, Q, last = x.shape
    U, g_max = groups.rows.shape
    grouped = x if groups.contiguous else x.index_select(0, groups.rows.reshape(-1))
    return grouped.reshape(U, g_max, hkv, H // hkv, Q, last).transpose(1, 2).reshape(U, hkv, g_max * (H // hkv) * Q,
                                                                                   last)


def _to_row_major(x: torch.Tensor, groups: RowGroups, heads: int, q_len: int) -> torch.Tensor:
    """The inverse of `_to_prompt_major`: (U, Hkv, Gmax*rep*Q, .) -> (R, H, Q, .) (padded slots dropped)."""
    U, hkv, _, last = x.shape
    g_max = groups.rows.size(1)
    rows = x.reshape(U, hkv, g_max, heads // hkv, q_len, last).transpose(1, 2).reshape(U * g_max, heads, q_len, last)
    return rows if groups.contiguous else rows.index_select(0, groups.inverse)


class _CausalCascade(torch.autograd.Function):
    """Forward: the two fused partial attentions (prefix: per prompt, padding bias; suffix: per row, causal) and
    the log-sum-exp merge. Backward: each part's fused backward given the MERGED output and log-sum-exp, which is
    the gradient of softmax attention over the union of keys restricted to that part (dS = P * (dP - rowsum(dO * O))
    with P and O those of the whole softmax), so the two parts' query gradients add up and the prompt's K/V get the
    sum over its G rows from the one batched product."""

    @staticmethod
    def forward(ctx, q, prefix_k, prefix_v, prefix_bias, suffix_k, suffix_v, scale, groups):
        R, H, Q, D = q.shape
        hkv = prefix_k.size(1)
        rep = H // hkv
        q_p = _to_prompt_major(q, groups, hkv)
        out_p, lse_p = _flash(q_p, prefix_k, prefix_v, 0.0, False, attn_mask=prefix_bias, scale=scale)
        out_p = _to_row_major(out_p, groups, H, Q)
        lse_p = _to_row_major(lse_p.unsqueeze(-1), groups, H, Q)
        k_s = suffix_k.repeat_interleave(rep, dim=1) if rep > 1 else suffix_k
        v_s = suffix_v.repeat_interleave(rep, dim=1) if rep > 1 else suffix_v
        out_s, lse_s = _flash(q, k_s, v_s, 0.0, True, scale=scale)
        lse_s = lse_s.unsqueeze(-1)
        lse = torch.logaddexp(lse_p, lse_s)
        stat = _stat_dtype(q.dtype)
        out = (torch.exp(lse_p - lse) * out_p.to(stat) + torch.exp(lse_s - lse) * out_s.to(stat)).to(q.dtype)
        ctx.save_for_backward(q, prefix_k, prefix_v, prefix_bias, suffix_k, suffix_v, out, lse)
        ctx.scale, ctx.groups = scale, groups
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, prefix_k, prefix_v, prefix_bias, suffix_k, suffix_v, out, lse = ctx.saved_tensors
        groups, scale = ctx.groups, ctx.scale
        R, H, Q, D = q.shape
        hkv = prefix_k.size(1)
        rep = H // hkv
        grad_out = grad_out.contiguous().to(q.dtype)
        # prefix part. Padded slots (unequal groups, or a prompt with no row in this call: an accumulation window's
        # prefix serves each micro-batch a subset of its prompts) hold some other row's query, output and MERGED
        # log-sum-exp, which belongs to that row's own prompt, not to this one: exp(S - lse) can overflow there
        # (inf x a zero gradient = NaN). A padded slot is no query at all: zero output gradient and lse = +inf, so
        # its probabilities exp(S - inf) are exactly 0 and it adds nothing to the prompt's K/V gradient.
        g_p = _to_prompt_major(grad_out, groups, hkv)
        lse_p = _to_prompt_major(lse, groups, hkv)
        if groups.valid is not None:
            U, g_max = groups.valid.shape
            padded = ~groups.valid.view(U, 1, g_max, 1, 1, 1)
            g_p = g_p.view(U, hkv, g_max, rep, Q, D).masked_fill(padded, 0.0).reshape(g_p.shape)
            lse_p = lse_p.view(U, hkv, g_max, rep, Q, 1).masked_fill(padded, float("inf")).reshape(lse_p.shape)
        dq_p, dk_p, dv_p = _flash_backward(g_p, _to_prompt_major(q, groups, hkv), prefix_k, prefix_v,
                                           _to_prompt_major(out, groups, hkv), lse_p.squeeze(-1).contiguous(), 0.0,
                                           False, attn_mask=prefix_bias, scale=scale)
        k_s = suffix_k.repeat_interleave(rep, dim=1) if rep > 1 else suffix_k
        v_s = suffix_v.repeat_interleave(rep, dim=1) if rep > 1 else suffix_v
        dq_s, dk_s, dv_s = _flash_backward(grad_out, q, k_s, v_s, out, lse.squeeze(-1).contiguous(), 0.0, True,
                                           scale=scale)
        if rep > 1:
            dk_s = dk_s.view(R, hkv, rep, *dk_s.shape[2:]).sum(2)
            dv_s = dv_s.view(R, hkv, rep, *dv_s.shape[2:]).sum(2)
        dq = _to_row_major(dq_p, groups, H, Q) + dq_s
        return dq, dk_p, dv_p, None, dk_s, dv_s, None, None


def causal_cascade_attention(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                             prefix_mask: torch.Tensor | None, groups: RowGroups, suffix_k: torch.Tensor,
                             suffix_v: torch.Tensor, scale: float) -> torch.Tensor:
    """`cascade_attention` for the scoring passes, differentiable, on PyTorch's fused CPU flash kernels.

    The suffix part is causal over the row's own tokens (queries = keys = the suffix: the last prompt token and
    the completion), which is all the mask a right-padded completion needs: a real token's keys are never after it,
    and a padding position's output is never scored. Unlike the concatenated path, the prompt's K/V are not copied
    to the G rows, and the causal half of the suffix is skipped block by block instead of being masked.

    Shapes as `cascade_attention` (suffix_k/v: (R, Hkv, Q, D)); CPU tensors of one floating dtype.
    """
    if q.size(2) != suffix_k.size(2):
        raise ValueError(f"the causal suffix needs one key per query, got {q.size(2)} queries, {suffix_k.size(2)} keys")
    bias = None
    if prefix_mask is not None and not bool(prefix_mask.bool().all()):
        U, P = prefix_mask.shape
        bias = torch.zeros(U, 1, 1, P, dtype=q.dtype, device=q.device).masked_fill(
            ~prefix_mask.bool().view(U, 1, 1, P), NEG_INF)
    return _CausalCascade.apply(q.contiguous(), prefix_k.contiguous(), prefix_v.contiguous(), bias,
                                suffix_k.contiguous(), suffix_v.contiguous(), scale, groups)

"""The cascade suffix (`suffix_logps(..., attention="cascade")`, prefix/suffix_attention.py) against the full
prompt+completion forward: log-probs/entropies to 1e-5, gradients to 1e-4 relative (fp32), under gradient
checkpointing too (whose recompute runs after the suffix call returns), long completions (C >> P) with mixed lengths,
and TRL's bf16 autocast against the concatenated path at bf16 rounding."""

from __future__ import annotations

import pytest
import test_prefix_exactness as exact
import torch
from test_prefix_exactness import (
    GRAD_RTOL,
    KINDS,
    LOGP_TOL,
    TEMPERATURE,
    _completions,
    advantages,
    assert_grads_match,
    assert_vision_grads_nonzero,
    full_plain,
    full_trl,
    grads_of,
    load_qwen2,
    load_vl,
    max_diff,
    pg_loss,
    text_batch,
    vl_batch,
)

from rollplex_trl.prefix import backward_prefix, detach_prefix, prefix_forward, suffix_logps
from rollplex_trl.prefix.cascade import causal_cascade_attention, group_rows, reference_attention
from rollplex_trl.prefix.suffix_attention import unsupported_reason

# the exactness module's fixtures (module-scoped processor/tokenizer, the quiet logging), shared
processor, tokenizer, _quiet = exact.processor, exact.tokenizer, exact._quiet

pytestmark = pytest.mark.filterwarnings("ignore")


def cascade_split(model, b, state=None, attention="cascade", keep_graph=False):
    state = state or prefix_forward(model, b.prompt_ids, b.prompt_mask, **b.prefix_inputs(), keep_graph=keep_graph)
    return suffix_logps(model, state, b.row_to_prompt, b.completion_ids, b.completion_mask,
                        temperature=TEMPERATURE, compute_entropy=True, attention=attention)


# ---- the attention function itself -----------------------------------------------------------------------------


@pytest.mark.parametrize("counts,order,Hkv", [((3, 3), False, 2), ((3, 3), True, 2), ((2, 4), False, 1),
                                              ((4, 4), False, 4)])
def test_causal_cascade_equals_concatenated_attention_and_its_gradients(counts, order, Hkv):
    """Values and all five gradients (queries, prompt K/V, own K/V) against plain attention on cat(prompt, own)
    with a causal own part: rows in any order, unequal groups (padded slots must add no prompt gradient), GQA/MQA."""
    torch.manual_seed(0)
    U, H, P, Q, D = len(counts), 4, 9, 7, 8
    rows = torch.cat([torch.full((c,), u) for u, c in enumerate(counts)])
    if order:
        rows = rows[torch.randperm(rows.numel())]
    R = rows.numel()
    tensors = [torch.randn(*shape, requires_grad=True) for shape in
               ((R, H, Q, D), (U, Hkv, P, D), (U, Hkv, P, D), (R, Hkv, Q, D), (R, Hkv, Q, D))]
    prompt_mask = torch.ones(U, P, dtype=torch.bool)
    prompt_mask[0, :3] = False  # left padding
    weights = torch.randn(R, H, Q, D)
    causal = torch.tril(torch.ones(Q, Q, dtype=torch.bool)).view(1, 1, Q, Q)
    ref = reference_attention(tensors[0], tensors[1], tensors[2], prompt_mask, rows, tensors[3], tensors[4], causal,
                              D ** -0.5)
    ref_grads = torch.autograd.grad((ref * weights).sum(), tensors)
    out = causal_cascade_attention(tensors[0], tensors[1], tensors[2], prompt_mask, group_rows(rows, U), tensors[3],
                                   tensors[4], D ** -0.5)
    grads = torch.autograd.grad((out * weights).sum(), tensors)
    assert max_diff(out, ref) <= 1e-5
    for name, g, r in zip(("q", "prefix_k", "prefix_v", "suffix_k", "suffix_v"), grads, ref_grads):
        assert ((g - r).abs().max() / r.abs().max()).item() <= 1e-5, name


# ---- log-probs (no grad: old/ref passes) -------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["video", "mixed", "text_vl"])
def test_cascade_logps_match_full_forward(tiny_vl_path, processor, kind, attn):
    b = vl_batch(processor, KINDS[kind], G=8)
    plain = load_vl(tiny_vl_path, attn)
    fused = load_vl(tiny_vl_path, attn, fused=True)
    with torch.no_grad():
        ref_lp, ref_ent = full_plain(plain, b)
        trl_lp, trl_ent = full_trl(fused, b)
        lp, ent = cascade_split(plain, b)
        flp, fent = cascade_split(fused, b)
    assert max_diff(lp, ref_lp) <= LOGP_TOL and max_diff(ent, ref_ent) <= LOGP_TOL
    assert max_diff(flp, trl_lp) <= LOGP_TOL and max_diff(fent, trl_ent) <= LOGP_TOL
    assert (lp[b.completion_mask == 0] == 0).all()
    # the switch is scoped: the model's attention implementation is its own again
    assert plain.config.get_text_config()._attn_implementation == attn


def test_long_completions_of_mixed_lengths(tiny_qwen2_path, tokenizer):
    """C >> P (the low prompt share the cascade is for): completions up to 48 tokens after ~12-token prompts."""
    b = text_batch(tokenizer, G=4)
    ids, mask, rows = _completions(3, 4, seed=3, max_len=48)
    b = type(b)(b.prompt_ids, b.prompt_mask, None, b.per_prompt_vision, ids, mask, rows)
    model = load_qwen2(tiny_qwen2_path, "sdpa", checkpointing=True).train()
    adv = advantages(b)
    ref_lp, _ = full_plain(model, b)
    pg_loss(ref_lp, b, adv).backward()
    ref = grads_of(model)
    model.zero_grad()
    lp, _ = cascade_split(model, b, keep_graph=True)
    pg_loss(lp, b, adv).backward()
    assert max_diff(lp, ref_lp) <= LOGP_TOL
    assert_grads_match(ref, grads_of(model))


# ---- gradients (the actor pass) ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,attn,fused,ckpt,mode", [
    ("mixed", "sdpa", True, True, "single"),  # TRL's defaults: fused head, checkpointing (recompute in backward)
    ("video", "eager", False, True, "two_stage"),
    ("mixed", "sdpa", False, False, "two_stage"),
])
def test_cascade_grads_match_full_forward(tiny_vl_path, processor, kind, attn, fused, ckpt, mode):
    b = vl_batch(processor, KINDS[kind], G=8)
    model = load_vl(tiny_vl_path, attn, fused=fused, checkpointing=ckpt)
    adv = advantages(b)
    ref_lp = full_trl(model, b)[0] if fused else full_plain(model, b)[0]
    pg_loss(ref_lp, b, adv).backward()
    ref = grads_of(model)
    model.zero_grad()
    state = prefix_forward(model, b.prompt_ids, b.prompt_mask, **b.prefix_inputs(), keep_graph=True)
    if mode == "single":
        lp, _ = cascade_split(model, b, state=state)
        pg_loss(lp, b, adv).backward()
    else:
        leaf_state, outputs = detach_prefix(state)
        lp, _ = cascade_split(model, b, state=leaf_state)
        pg_loss(lp, b, adv).backward()
        backward_prefix(outputs, leaf_state)
    got = grads_of(model)
    assert max_diff(lp, ref_lp) <= LOGP_TOL
    assert_grads_match(ref, got, GRAD_RTOL)
    assert_vision_grads_nonzero(got)


def test_bf16_autocast_with_checkpointing_matches_the_concatenated_path(tiny_vl_path, processor):
    """TRL's defaults (bf16 autocast on CPU, gradient checkpointing): cascade vs concat, same prefix, at bf16
    rounding (each is one bf16 computation of the same sums, grouped differently)."""
    b = vl_batch(processor, KINDS["mixed"], G=8)
    model = load_vl(tiny_vl_path, "sdpa", fused=True, checkpointing=True)
    adv = advantages(b)
    results = {}
    for attention in ("concat", "cascade"):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            state = prefix_forward(model, b.prompt_ids, b.prompt_mask, **b.prefix_inputs(), keep_graph=True)
            lp, _ = cascade_split(model, b, state=state, attention=attention)
            loss = pg_loss(lp.float(), b, adv)
        loss.backward()
        results[attention] = (lp.detach().float(), grads_of(model))
    (lp_c, g_c), (lp_s, g_s) = results["concat"], results["cascade"]
    assert max_diff(lp_s, lp_c) <= 0.05  # bf16 log-probs of a 150k vocabulary: ~1e-2 absolute
    norm_c = torch.sqrt(sum((g.float() ** 2).sum() for g in g_c.values() if g is not None))
    norm_s = torch.sqrt(sum((g.float() ** 2).sum() for g in g_s.values() if g is not None))
    assert abs(norm_s / norm_c - 1) <= 2e-2, (norm_s, norm_c)


# ---- where it applies ---------------------------------------------------------------------------------------------


def test_where_the_cascade_applies(tiny_qwen2_path):
    """The fact the run plan decides from (its decision: tests/test_components.py)."""
    model = load_qwen2(tiny_qwen2_path, "sdpa")
    assert unsupported_reason(model, torch.device("cpu")) is None
    assert "CPU only" in unsupported_reason(model, torch.device("cuda"))
    model.config.get_text_config()._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in unsupported_reason(model, torch.device("cpu"))


# ---- degenerate batches and peaked attention (the NaN of issue 31) ------------------------------------------------


@pytest.mark.parametrize("counts", [(3, 0), (0, 2), (3, 1), (1, 0, 2)])
def test_padded_slots_get_no_weight_under_peaked_scores(counts):
    """A prompt with fewer rows than the largest group (or none: an accumulation window's prefix serves each
    micro-batch a subset of its prompts) is padded with another row's query, output and merged log-sum-exp. Its
    backward must give those slots no weight: before the fix the prefix half's backward got the other prompt's lse,
    exp(S - lse) overflowed on peaked scores and inf x 0 made the prompt keys' gradient NaN (lr 0.1 training)."""
    torch.manual_seed(1)
    U, H, Hkv, P, Q, D = len(counts), 4, 2, 5, 6, 16
    rows = torch.cat([torch.full((c,), u) for u, c in enumerate(counts)])
    R = rows.numel()
    peaked = 6.0  # scores of ~30-80, as a collapsing policy's attention has
    shapes = ((R, H, Q, D), (U, Hkv, P, D), (U, Hkv, P, D), (R, Hkv, Q, D), (R, Hkv, Q, D))
    tensors = [(torch.randn(*shape) * (peaked if i in (0, 1, 3) else 1.0)).requires_grad_() for i, shape in
               enumerate(shapes)]
    with torch.no_grad():  # padded slots repeat row 0: keys along its queries make their scores dwarf its own lse
        for u, c in enumerate(counts):
            if c < max(counts):
                tensors[1][u] = tensors[0][0, ::H // Hkv, :1].detach() * 3
    prompt_mask = torch.ones(U, P, dtype=torch.bool)
    prompt_mask[-1, :2] = False
    weights = torch.randn(R, H, Q, D)
    causal = torch.tril(torch.ones(Q, Q, dtype=torch.bool)).view(1, 1, Q, Q)
    ref = reference_attention(*tensors[:3], prompt_mask, rows, *tensors[3:], causal, D ** -0.5)
    ref_grads = torch.autograd.grad((ref * weights).sum(), tensors)
    out = causal_cascade_attention(*tensors[:3], prompt_mask, group_rows(rows, U), *tensors[3:], D ** -0.5)
    grads = torch.autograd.grad((out * weights).sum(), tensors)
    assert max_diff(out, ref) <= 1e-4
    for name, g, r in zip(("q", "prefix_k", "prefix_v", "suffix_k", "suffix_v"), grads, ref_grads):
        assert torch.isfinite(g).all(), name
        assert ((g - r).abs().max() / r.abs().max().clamp(min=1e-30)).item() <= 1e-4, name
    for u, c in enumerate(counts):
        if c == 0:  # a prompt no row attends to gets no gradient at all
            assert grads[1][u].abs().max() == 0 and grads[2][u].abs().max() == 0


def _degenerate(b, case):
    """`b` with its completions replaced: one token each, the full width for every row, rows of padding only,
    or nothing but padding (every completion empty)."""
    R, C = b.completion_ids.shape
    ids, mask = b.completion_ids.clone(), torch.ones_like(b.completion_mask)
    if case == "one_token":
        ids, mask = ids[:, :1], mask[:, :1]
    elif case == "padding_rows":
        mask = b.completion_mask.clone()
        mask[1::3] = 0
    elif case == "all_padding":
        mask = torch.zeros_like(mask)
    ids = ids.masked_fill(mask == 0, 0)
    return type(b)(b.prompt_ids, b.prompt_mask, b.mm_token_type_ids, b.per_prompt_vision, ids, mask, b.row_to_prompt)


def _sharpen_attention(model, factor):
    """Scale every q/k projection: scores grow by factor**2 (a collapsed policy's peaked attention)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name or "visual" not in name:
                if ".q_proj." in name or ".k_proj." in name:
                    p.mul_(factor)


@pytest.mark.parametrize("case", ["one_token", "full_length", "padding_rows", "all_padding"])
@pytest.mark.parametrize("subset", [False, True])
def test_degenerate_completions_match_concat_and_full_forward(tiny_qwen2_path, tokenizer, case, subset):
    """Cascade vs the concatenated path vs the full forward, log-probs and every gradient, on degenerate
    completions with peaked attention, under gradient checkpointing. `subset`: the micro-batch holds the rows of
    some of the prefix's prompts only (as under gradient accumulation), the case that made NaN."""
    b = _degenerate(text_batch(tokenizer, G=3), case)
    model = load_qwen2(tiny_qwen2_path, "sdpa", checkpointing=True).train()
    _sharpen_attention(model, 12.0)
    rows = torch.nonzero(b.row_to_prompt == 1)[:, 0] if subset else torch.arange(b.row_to_prompt.numel())
    sub = b.select_rows(rows)
    adv = advantages(sub)

    def loss_of(lp):
        mask = sub.completion_mask.float()
        return -(lp * mask * adv).sum() / mask.sum().clamp(min=1.0) + 0.0 * lp.sum()

    model.zero_grad()
    ref_lp, _ = full_plain(model, sub)
    loss_of(ref_lp).backward()
    ref = grads_of(model)
    results = {}
    for attention in ("concat", "cascade"):
        model.zero_grad()
        state = prefix_forward(model, b.prompt_ids, b.prompt_mask, keep_graph=True)
        leaf_state, outputs = detach_prefix(state)
        lp, _ = cascade_split(model, sub, state=leaf_state, attention=attention)
        loss_of(lp).backward()
        backward_prefix(outputs, leaf_state)
        results[attention] = (lp.detach(), grads_of(model))
    for attention, (lp, got) in results.items():
        assert torch.isfinite(lp).all(), attention
        assert all(g is None or torch.isfinite(g).all() for g in got.values()), attention
        assert max_diff(lp, ref_lp) <= LOGP_TOL, attention
        assert_grads_match(ref, got)

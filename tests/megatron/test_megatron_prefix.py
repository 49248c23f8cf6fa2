"""The shared prefix on the Megatron backend (backends/megatron/prefix.py) against MegatronPolicy.token_logps.

Rows of two video prompts of different lengths interleaved (G = 3 and 2; G = 4 in the slow variant), left-padded
prompts, right-padded completions of different lengths, temperature 0.7, entropies: log-probs and entropies 1e-5 max
abs, every GPTModel gradient (this rank's TP layout) and the vision tower's 1e-4 relative, at t = 1 in this process
and t = 2 over 2 processes (gloo); bf16 autocast against the full pass under the same autocast (see prefix_worker.py
for the tolerances and what is measured). Qwen2 (1-D RoPE) with prompts of one chunk narrower than the batch.
"""

from __future__ import annotations

import json
import socket

import megatron_worker as mw
import prefix_worker as pw
import pytest
import torch
import torch.multiprocessing as mp

from helpers import record_prefill_states, require

require("megatron.core")
pytestmark = pytest.mark.filterwarnings("ignore")

CHECKS = ["unique prompts and vision tower once per prompt", "logps fp32", "entropy fp32",
          "padded completion positions too", "GPTModel grads (this rank's layout)", "vision tower grads",
          "sensitivity: the other prompt's K/V change the log-probs", "no_grad, one prompt per chunk"]
# t > 1 only: the transformers rollout decoding from the TP policy's prefill (prefix_worker.rollout_prefill_checks)
TP_CHECKS = ["rollout prefill, KV heads gathered: K/V equal HF's",
             "rollout prefill, KV heads gathered: HF's greedy tokens"]
BF16_CHECKS = ["bf16 autocast logps vs full bf16", "bf16 autocast entropy vs full bf16",
               "bf16 autocast grads vs full bf16"]


def _assert_records(records: list[dict], check: str) -> list[dict]:
    failed = [r for r in records if r["check"] == "no exception"]
    assert not failed, failed[0]["detail"]
    mine = [r for r in records if r["check"] == check]
    assert mine, f"no record of {check!r}"
    bad = [f"rank {r['rank']}: {r['detail']} (value {r['value']})" for r in mine if not r["ok"]]
    assert not bad, f"{check}: " + "; ".join(bad)
    return mine


def _spawn(path, out, bf16: bool) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(pw.main, args=(2, port, str(path), str(out), bf16), nprocs=2)
    finally:
        records = [r for p in sorted(out.glob("rank*.json")) for r in json.loads(p.read_text())]
    return records


@pytest.fixture(scope="module")
def two_ranks(tiny_vl_path, tmp_path_factory):
    return _spawn(tiny_vl_path, tmp_path_factory.mktemp("megatron-prefix-2ranks"), bf16=False)


@pytest.mark.parametrize("check", CHECKS + TP_CHECKS)
def test_tensor_parallel_2(two_ranks, check):
    mine = _assert_records(two_ranks, check)
    assert {r["rank"] for r in mine} == {0, 1}


@pytest.mark.slow
def test_tensor_parallel_2_bf16(tiny_vl_path, tmp_path):
    records = _spawn(tiny_vl_path, tmp_path, bf16=True)
    for check in CHECKS + TP_CHECKS + BF16_CHECKS:
        assert {r["rank"] for r in _assert_records(records, check)} == {0, 1}


def _single(path, **kwargs) -> list[dict]:
    records: list[dict] = []

    def record(check, ok=True, detail="", value=None):
        records.append({"case": "t1", "rank": 0, "check": check, "ok": bool(ok), "detail": detail, "value": value})

    pw.equivalence_checks(path, 1, record, **kwargs)
    return records


@pytest.fixture(scope="module")
def single_records(one_process, tiny_vl_path):
    return _single(tiny_vl_path)


@pytest.mark.parametrize("check", CHECKS + BF16_CHECKS)
def test_single_process(single_records, check):
    _assert_records(single_records, check)


@pytest.mark.slow
def test_single_process_group_of_four(one_process, tiny_vl_path):
    records = _single(tiny_vl_path, order=(1, 0, 1, 1, 0, 1), bf16=False)
    for check in CHECKS:
        _assert_records(records, check)


def test_full_path_unchanged_and_inert_hook(one_process, tiny_vl_path):
    """GPTModel's core attention is PrefixCoreAttention, inert outside a pass: with its SDPA path off the full
    forward equals one through megatron's own DotProductAttention bit for bit (same weights); with it on (the
    default) within float tolerance."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel
    from rollplex_trl.backends.megatron.prefix import PrefixCoreAttention, _core_attentions

    policy = MegatronPolicy(mw.load_hf(tiny_vl_path), init_model_parallel(1))
    modules = _core_attentions(policy)
    assert all(type(m) is PrefixCoreAttention and m.prefix_hook is None for m in modules)
    batch = mw.video_batch(tiny_vl_path)
    with torch.no_grad():
        sdpa, _ = mw.policy_logps(policy, batch)
        for m in modules:
            m.use_sdpa = False
        unfused, _ = mw.policy_logps(policy, batch)
        for m in modules:
            del m.use_sdpa
            m.__class__ = DotProductAttention
        try:
            want, _ = mw.policy_logps(policy, batch)
        finally:
            for m in modules:
                m.__class__ = PrefixCoreAttention
    assert torch.equal(unfused, want)
    assert not torch.equal(sdpa, want), "the SDPA path did not run"
    assert (sdpa - want).abs().max() <= 1e-5


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("shape", ["prefix", "suffix"])
def test_sdpa_core_attention_equals_dot_product_attention(one_process, tiny_vl_path, autocast, shape):
    """The fused path against megatron's DotProductAttention (the reference) on one layer: 4 query heads over 2 KV
    groups, a left-padded row (fully masked query rows), the full pass's causal mask ("prefix") or the suffix's
    (S queries after P-1 cached keys); outputs and the q/k/v gradients, on the real (unpadded) query rows."""
    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel
    from rollplex_trl.backends.megatron.prefix import _core_attentions

    module = _core_attentions(MegatronPolicy(mw.load_hf(tiny_vl_path), init_model_parallel(1)))[0]
    heads, groups = module.num_attention_heads_per_partition, module.num_query_groups_per_partition
    assert heads > groups, "the tiny model has no GQA: the test would not cover the head grouping"
    hd, b = module.hidden_size_per_attention_head, 3
    sk = 23
    sq = sk if shape == "prefix" else 6
    gen = torch.Generator().manual_seed(0)
    q0 = torch.randn(sq, b, heads, hd, generator=gen)
    k0, v0 = (torch.randn(sk, b, groups, hd, generator=gen) for _ in range(2))
    pad = torch.zeros(b, sk, dtype=torch.bool)
    pad[1, :7] = True  # row 1 left-padded: its first query rows (prefix) see no key
    mask = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)[None, None] | pad[:, None, None, :]
    real = ~pad[:, sk - sq:].T  # [sq, b]: query rows that are tokens

    def run(use_sdpa):
        module.use_sdpa = use_sdpa
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = module(q, k, v, mask)
        (out.float().view(sq, b, heads, hd) * real[..., None, None]).square().sum().backward()
        del module.use_sdpa
        return out.float().view(sq, b, -1)[real], q.grad[real], k.grad, v.grad

    got, want = run(True), run(False)
    tol = 3e-2 if autocast else 1e-5  # bf16: the two kernels round differently (values of order 1)
    for name, a, w in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        err = ((a - w).norm() / w.norm()).item() if autocast else (a - w).abs().max().item()
        assert err <= tol, f"{name}: {err}"


def test_precomputed_states(one_process, tiny_vl_path):
    """States built ahead (the overlap's decode window) at the batch's full width serve the same log-probs."""
    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel
    from rollplex_trl.backends.megatron.prefix import megatron_precompute_prefix, megatron_shared_prefix_logps

    policy = MegatronPolicy(mw.load_hf(tiny_vl_path), init_model_parallel(1))
    batch = pw.group_batch(tiny_vl_path)
    P = batch["input_ids"].size(1) - batch["K"]
    with torch.no_grad():
        ref, ref_ent = pw.full_logps(policy, batch)
        pre = megatron_precompute_prefix(policy, batch["input_ids"][:, :P], batch["attention_mask"][:, :P],
                                         batch["rows"], keep_graph=False, prompts_per_chunk=1)
        logps, ent, U = megatron_shared_prefix_logps(
            policy, batch["input_ids"], batch["attention_mask"], batch["K"], batch["rows"],
            temperature=mw.TEMPERATURE, compute_entropy=True, prompts_per_chunk=1, precomputed=pre)
    assert U == 2 and pre.state.num_prompts == 2 and pre.state.rope_index
    assert (logps - ref).abs().max() <= pw.LOGP_TOL and (ent - ref_ent).abs().max() <= pw.LOGP_TOL


def test_text_model_qwen2_one_d_rope(one_process, tiny_qwen2_path):
    """Qwen2 (1-D RoPE), rows grouped by their tokens (no PreparedPrompt): prompts left-padded to different lengths,
    one prompt per chunk so a chunk drops padding columns (its positions keep the column offset), completions
    right-padded; log-probs, entropies and gradients equal token_logps'."""
    from transformers import AutoModelForCausalLM

    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel
    from rollplex_trl.backends.megatron.prefix import megatron_shared_prefix_logps

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32, attn_implementation="eager")
    policy = MegatronPolicy(hf, init_model_parallel(1))
    gen = torch.Generator().manual_seed(5)
    P, C = 9, 5
    prompts = [torch.randint(10, 700, (n,), generator=gen) for n in (9, 5, 7)]
    order = [1, 0, 2, 1, 0, 2, 2]
    ids, mask = [], []
    for r, u in enumerate(order):
        n = prompts[u].numel()
        cm = (torch.arange(C) < C - r % 3).long()
        comp = torch.randint(10, 700, (C,), generator=gen).masked_fill(cm == 0, 0)
        ids.append(torch.cat([torch.zeros(P - n, dtype=torch.long), prompts[u], comp]))
        mask.append(torch.cat([torch.zeros(P - n, dtype=torch.long), torch.ones(n, dtype=torch.long), cm]))
    ids, mask = torch.stack(ids), torch.stack(mask)
    batch = {"completion_mask": mask[:, -C:]}
    ref, ref_ent = policy.token_logps(ids, mask, C, temperature=mw.TEMPERATURE, compute_entropy=True)
    mw.loss_of(ref, ref_ent, batch).backward()
    want = {n: p.grad.clone() for n, p in policy.gpt.named_parameters()}
    policy.zero_grad(set_to_none=True)
    logps, ent, U = megatron_shared_prefix_logps(policy, ids, mask, C, None, temperature=mw.TEMPERATURE,
                                                 compute_entropy=True, prompts_per_chunk=1)
    assert U == 3
    assert (logps - ref).abs().max() <= pw.LOGP_TOL and (ent - ref_ent).abs().max() <= pw.LOGP_TOL
    mw.loss_of(logps, ent, batch).backward()
    worst = max(mw.rel_err(p.grad, want[n]) for n, p in policy.gpt.named_parameters())
    assert worst <= pw.GRAD_RTOL


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("shared_decode", ["off", "on"])
def test_rollout_decodes_from_the_policy_prefill(one_process, tiny_vl_path, monkeypatch, precision, shared_decode):
    """The transformers rollout decoding from the Megatron policy's prefix K/V
    (`generate_with_shared_prefill(prefill=)`, what the trainer does at t = 1) against HF's own `generate` on the
    same weights: two video prompts of different lengths (left-padded rows), G = 3, the prompt's K/V expanded or
    shared. fp32: the same greedy tokens, and the K/V equal HF's prefill (`past_key_values` of prompt[:, :-1])
    within 1e-5. bf16 (the trainer's autocast, which the prefill runs in as TRL's generate does): the K/V in HF's
    dtype, within bf16 rounding of HF's, and the first decode step's logits within 2e-2 of HF's. t = 2:
    prefix_worker.py ("rollout prefill, KV heads gathered")."""
    import contextlib

    from transformers import GenerationConfig

    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel
    from rollplex_trl.prefix import generation
    from rollplex_trl.prefix.generation import generate_with_shared_prefill

    hf = mw.load_hf(tiny_vl_path).eval()
    policy = MegatronPolicy(hf, init_model_parallel(1))
    prefill = pw.rollout_prefill(policy)
    bf16 = precision == "bf16"

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    G = 3
    rows, inputs = pw.video_generate_inputs(tiny_vl_path, G)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=[],
                              output_logits=True, return_dict_in_generate=True)
    _, unique = pw.video_generate_inputs(tiny_vl_path, 1)
    with torch.no_grad(), autocast():
        wanted = hf.model(**{k: v[:, :-1] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
                             for k, v in unique.items()}, use_cache=True).past_key_values
        plain = hf.generate(**inputs, generation_config=config)
    states = record_prefill_states(monkeypatch)
    with torch.no_grad():
        ours = generate_with_shared_prefill(hf, **inputs, rows=rows, shared_decode=shared_decode,
                                            forward_context=autocast, prefill=prefill, generation_config=config)
    (state,) = states
    width = state.keys[0].size(2)
    with autocast():  # what the decode cache holds: Megatron's K/V cast to the dtypes HF's own prefill caches
        dtypes = generation.decode_kv_dtypes(hf)
    for layer, (k, v) in enumerate(zip(state.keys, state.values, strict=True)):
        for name, got, want in (("keys", k, wanted.layers[layer].keys), ("values", v, wanted.layers[layer].values)):
            want = want[:, :, -width:]
            assert dtypes[name == "values"] == want.dtype, (layer, name, dtypes, want.dtype)
            scale = want.float().abs().max().item()
            err = (got.float() - want.float()).abs().max().item()
            assert err <= (1e-2 * scale if bf16 else 1e-5), (layer, name, err, scale)
    if bf16:  # the kernels round differently: compare the first step's scores, not whole greedy runs
        assert (ours.logits[0] - plain.logits[0]).abs().max() <= 2e-2 * plain.logits[0].abs().max()
    else:
        assert torch.equal(ours.sequences, plain.sequences)


def test_rollout_prefill_only_for_mrope_models(one_process, tiny_qwen2_path):
    """Qwen2's 1-D RoPE decode numbers a padded row's new tokens from its first real token; Megatron's prefix
    numbers columns, so the rollout keeps its own prefill there."""
    from transformers import AutoModelForCausalLM

    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32, attn_implementation="eager")
    assert pw.rollout_prefill(MegatronPolicy(hf, init_model_parallel(1))) is None


def test_rollout_decodes_text_prompts_from_the_policy_prefill(one_process, tiny_vl_path):
    """Text-only prompts of different lengths on the VL model (rows None: grouped by their tokens): Megatron's prefix
    numbers the left-padded columns from 0, HF's `generate` from each row's first real token; the decode continues
    from the state's last position, so HF's greedy tokens (fp32)."""
    from transformers import AutoTokenizer, GenerationConfig

    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel
    from rollplex_trl.prefix.generation import generate_with_shared_prefill

    hf = mw.load_hf(tiny_vl_path).eval()
    policy = MegatronPolicy(hf, init_model_parallel(1))
    tok = AutoTokenizer.from_pretrained(tiny_vl_path, padding_side="left")
    texts = ["count the balls", "a much longer prompt about red balls moving left and right across the frame"]
    enc = dict(tok([t for t in texts for _ in range(3)], return_tensors="pt", padding=True))
    assert not bool(enc["attention_mask"].all())  # left padding in the batch
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=[])
    seen = []
    with torch.no_grad():
        plain = hf.generate(**enc, generation_config=config)
        ours = generate_with_shared_prefill(hf, **enc, on_prefill=lambda rows, unique: seen.append((rows, unique)),
                                            prefill=pw.rollout_prefill(policy), generation_config=config)
    assert seen == [(6, 2)] and torch.equal(ours, plain)

"""MegatronPolicy (rollplex_backend="megatron") against the HF model's own full forward, on a real video batch.

t = 2 and t = 1 x 2 data-parallel ranks run in 2 spawned processes (gloo; see megatron_worker.py for every check);
t = 1 in a 1-process world runs here. Tolerances: log-probs and entropies 1e-5 max abs (fp32), every gradient
1e-4 relative, bf16 autocast log-probs 2e-2 max abs against the fp32 reference (measured ~2e-3).
"""

from __future__ import annotations

import dataclasses
import json
import socket

import megatron_worker as mw
import pytest
import torch
import torch.multiprocessing as mp

from helpers import require

require("megatron.core")
pytestmark = pytest.mark.filterwarnings("ignore")

CHECKS = ["groups", "hf_state_dict round trip is exact", "round trip in one-tensor buckets", "logps fp32",
          "entropy fp32",
          "megatron grads == HF grads in this rank's layout", "vision tower grads == HF grads",
          "grad norm == torch clip_grad_norm_ over HF grads", "clipped grads == torch's clipped HF grads",
          "logps bf16 autocast", "entropy bf16 autocast", "copy_into_hf: HF forward == megatron forward after a step",
          "copy_into_hf bytes", "replicated grads: the first rank's on every rank"]


def _assert_records(records: list[dict], case: str, check: str) -> list[dict]:
    mine = [r for r in records if r["case"] == case and r["check"] == check]
    failed = [r for r in records if r["check"] == "no exception"]
    assert not failed, failed[0]["detail"]
    assert mine, f"no record of {check!r} in case {case}"
    bad = [f"rank {r['rank']}: {r['detail']} (value {r['value']})" for r in mine if not r["ok"]]
    assert not bad, f"{check}: " + "; ".join(bad)
    return mine


@pytest.fixture(scope="module")
def two_ranks(tiny_vl_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron-2ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(mw.main, args=(2, port, str(tiny_vl_path), str(out)), nprocs=2)
    finally:
        records = [r for p in sorted(out.glob("rank*.json")) for r in json.loads(p.read_text())]
    return records


KV_CHECKS = ["kv replicated: logps and entropies", "kv replicated: grads",
             "kv replicated: grad norm counts k/v rows once", "kv replicated: round trip"]
SPLIT_CHECKS = [f"split vision ({label}): {check}" for label in ("two items", "one item")
                for check in ("the tower ran on this rank's items only", "logps",
                              "vision tower grads == HF grads after the TP sum", "LLM grads == HF grads")]


@pytest.mark.parametrize("check", CHECKS + ["megatron all-gather on CPU"] + KV_CHECKS + SPLIT_CHECKS)
def test_tensor_parallel_2_matches_hf(two_ranks, check):
    mine = _assert_records(two_ranks, "t2", check)
    assert {r["rank"] for r in mine} == {0, 1}


@pytest.mark.parametrize("check", ["dp groups", "dp average == mean", "changing t is refused"])
def test_data_parallel_2(two_ranks, check):
    _assert_records(two_ranks, "dp2", check)


@pytest.fixture(scope="module")
def single_records(one_process, tiny_vl_path):
    records: list[dict] = []

    def record(check, ok=True, detail="", value=None):
        records.append({"case": "t1", "rank": 0, "check": check, "ok": bool(ok), "detail": detail, "value": value})

    mw.equivalence_checks(tiny_vl_path, 1, record)
    return records


@pytest.mark.parametrize("check", CHECKS)
def test_single_process_matches_hf(single_records, check):
    _assert_records(single_records, "t1", check)


def test_text_model_qwen2(one_process, tiny_qwen2_path):
    """Qwen2 (1-D RoPE, no vision): log-probs and entropies of a left-padded batch equal HF's."""
    from transformers import AutoModelForCausalLM

    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32, attn_implementation="eager")
    policy = MegatronPolicy(hf, init_model_parallel(1))
    assert policy.visual is None
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(10, 700, (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :2] = 0
    mask[0, -2:] = 0
    K = 5
    logits = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -K - 1:-1]
    ref = torch.log_softmax(logits / mw.TEMPERATURE, -1)
    logps, ent = policy.token_logps(ids, mask, K, temperature=mw.TEMPERATURE, compute_entropy=True)
    assert (logps - ref.gather(-1, ids[:, -K:, None]).squeeze(-1)).abs().max() <= mw.LOGP_TOL
    assert (ent + (ref.exp() * ref).sum(-1)).abs().max() <= mw.LOGP_TOL
    sd = policy.hf_state_dict()
    assert all(torch.equal(sd[n], p) for n, p in hf.named_parameters())


def test_bad_tensor_parallel_size_is_named(one_process, tiny_vl_path):
    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel

    hf = mw.load_hf(tiny_vl_path)
    groups = init_model_parallel(1)
    with pytest.raises(ValueError, match=r"rollplex_tensor_parallel_size=3 .*num_attention_heads=4"):
        MegatronPolicy(hf, dataclasses.replace(groups, tp_size=3))
    with pytest.raises(ValueError, match="rollplex_tensor_parallel_size=2 must divide the number of processes"):
        init_model_parallel(2)


def test_image_prompt_and_own_vision_copy(one_process, tiny_vl_path):
    """An image prompt beside a video prompt; and a policy whose vision tower was swapped for a copy (what the
    trainer does) runs that copy: same log-probs, gradients land in the copy, none in the HF model's tower."""
    import copy

    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel

    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 84, 3), dtype=np.uint8))
    chat = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                         "text": "Colour?"}]}],
                                         tokenize=False, add_generation_prompt=True)
    p = processor(text=[chat], images=[image], return_tensors="pt")
    K = 4
    completion = torch.randint(10, 700, (1, K), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": torch.cat([p["input_ids"], completion], 1),
             "attention_mask": torch.cat([p["attention_mask"], torch.ones_like(completion)], 1),
             "mm_token_type_ids": torch.cat([p["mm_token_type_ids"], torch.zeros_like(completion)], 1),
             "pixel_values": p["pixel_values"], "image_grid_thw": p["image_grid_thw"], "K": K}
    hf = mw.load_hf(tiny_vl_path)
    inputs = {k: v for k, v in batch.items() if k != "K"}
    logits = hf(**inputs, use_cache=False).logits[:, -K - 1:-1]
    ref = torch.log_softmax(logits / mw.TEMPERATURE, -1).gather(-1, completion[..., None]).squeeze(-1)

    policy = MegatronPolicy(hf, init_model_parallel(1))
    policy.visual = copy.deepcopy(policy.visual)
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    logps, _ = policy.token_logps(ids, mask, K, temperature=mw.TEMPERATURE, **inputs)
    assert (logps - ref).abs().max() <= mw.LOGP_TOL
    logps.sum().backward()
    assert all(p.grad is not None for p in policy.visual.parameters())
    assert all(p.grad is None for p in hf.model.visual.parameters())


def test_bf16_parameters(one_process, tiny_vl_path):
    """An HF model loaded in bf16: GPTModel in bf16 (norms too, as in HF), log-probs equal to HF's bf16 forward
    (megatron's unfused attention vs HF's eager, the same arithmetic: measured 5e-7; the default fused attention
    vs HF's eager and sdpa within bf16 rounding: 2.8e-3 measured on log-probs of ~7, a bf16 step is 3e-2), finite
    bf16 gradients, and an exact round trip with HF dtypes."""
    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel
    from rollplex_trl.backends.megatron.prefix import PrefixCoreAttention

    hf = mw.load_hf(tiny_vl_path, dtype=torch.bfloat16)
    batch = mw.video_batch(tiny_vl_path)
    ref, _ = mw.hf_logps(hf, batch)
    hf.set_attn_implementation("sdpa")
    ref_sdpa, _ = mw.hf_logps(hf, batch)
    hf.set_attn_implementation("eager")
    policy = MegatronPolicy(hf, init_model_parallel(1))
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    PrefixCoreAttention.use_sdpa = False
    try:
        with torch.no_grad():
            unfused, _ = mw.policy_logps(policy, batch)
    finally:
        PrefixCoreAttention.use_sdpa = True
    assert (unfused - ref).abs().max() <= 1e-4
    logps, entropy = mw.policy_logps(policy, batch)
    assert (logps - ref).abs().max() <= 1e-2 and (logps - ref_sdpa).abs().max() <= 1e-2
    mw.loss_of(logps, entropy, batch).backward()
    assert all(p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all() for p in policy.gpt.parameters())
    sd = policy.hf_state_dict()
    assert all(sd[n].dtype == p.dtype and torch.equal(sd[n], p) for n, p in hf.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_logps_unsplit_equals_log_softmax(dtype):
    """tp_group=None (one shard = the whole vocabulary): values and gradients of log-probs and entropies equal
    torch's log_softmax on the fp32-upcast logits (the split case runs in the model tests at t = 2)."""
    from rollplex_trl.backends.megatron import vocab_parallel_logps

    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 33, generator=gen)).to(dtype).requires_grad_(True)
    targets = torch.randint(0, 33, (2, 5), generator=gen)
    w1, w2 = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    logps, entropy = vocab_parallel_logps(logits, targets, temperature=0.7, tp_group=None, compute_entropy=True)
    (logps * w1 + entropy * w2).sum().backward()
    got = logits.grad.clone()
    logits.grad = None
    ref = torch.log_softmax(logits.float() / 0.7, -1)
    ref_logps, ref_entropy = ref.gather(-1, targets[..., None]).squeeze(-1), -(ref.exp() * ref).sum(-1)
    (ref_logps * w1 + ref_entropy * w2).sum().backward()
    assert (logps - ref_logps).abs().max() <= 1e-5 and (entropy - ref_entropy).abs().max() <= 1e-5
    assert got.dtype == dtype and mw.rel_err(got.float(), logits.grad.float()) <= 1e-5
    logps_only, none = vocab_parallel_logps(logits, targets, tp_group=None)
    assert none is None and logps_only.dtype == torch.float32


def test_tied_embeddings(one_process, tiny_qwen2_path):
    """tie_word_embeddings=True: GPTModel shares its embedding as the output layer (no output_layer.weight) and
    the round trip has no separate lm_head, as HF's named_parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel

    config = AutoConfig.from_pretrained(tiny_qwen2_path)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()
    policy = MegatronPolicy(hf, init_model_parallel(1))
    assert policy.tied and not any("output_layer" in n for n, _ in policy.gpt.named_parameters())
    ids = torch.randint(10, 700, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ref = torch.log_softmax(hf(input_ids=ids, attention_mask=mask).logits[:, -4:-1], -1)
    logps, _ = policy.token_logps(ids, mask, 3)
    assert (logps - ref.gather(-1, ids[:, -3:, None]).squeeze(-1)).abs().max() <= mw.LOGP_TOL
    sd = policy.hf_state_dict()
    assert sd.keys() == dict(hf.named_parameters()).keys()
    assert all(torch.equal(sd[n], p) for n, p in hf.named_parameters())


def test_split_vision_names_pixel_rows_that_disagree_with_the_grid():
    """Before any collective: pixel rows that do not match grid_thw would make every rank slice wrong rows."""
    from rollplex_trl.backends.megatron.vision_split import VisionSplit, split_vision_features

    visual = torch.nn.Module()
    split = VisionSplit(tp_rank=0, tp_size=2, all_reduce=lambda x: x)
    with pytest.raises(ValueError, match=r"grid_thw rows \[\[2, 4, 4\]\] describe 32 patch rows, the pixel values "
                                         r"have 30"):
        split_vision_features(visual, torch.zeros(30, 8), torch.tensor([[2, 4, 4]]), split,
                              dtype=torch.float32, hidden=16)

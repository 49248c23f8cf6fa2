"""Shared-prefix log-probs (rollplex_trl.prefix) against the full prompt+completion forward, fp32 on tiny checkpoints.

Every check builds its reference the way TRL does: one plain forward over cat(prompt, completion) with one copy of
the vision inputs per row, then either log_softmax(logits / T) + gather, or TRL's fused LM head with labels.
Log-probs and entropies must agree to 1e-5 (max abs), every parameter's gradient to 1e-4 (max|g1-g2| / max|g1|).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image

from rollplex_trl.prefix import PrefixState, backward_prefix, detach_prefix, prefix_forward, suffix_logps

TEMPERATURE = 0.7
LOGP_TOL = 1e-5
GRAD_RTOL = 1e-4
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def _quiet():
    # transformers logs about checkpointing vs caching on every call; the tests check the numbers instead
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


# ----------------------------------------------------------------------------------------------------------------
# Models and batches
# ----------------------------------------------------------------------------------------------------------------


def load_vl(path, attn="eager", fused=False, checkpointing=False):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    return _prepare(model, fused, checkpointing)


def load_qwen2(path, attn="eager", fused=False, checkpointing=False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    return _prepare(model, fused, checkpointing)


def _prepare(model, fused, checkpointing, reentrant=False):
    if fused:  # what GRPOTrainer.__init__ does to the policy and the ref model
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()  # checkpointing only acts in training mode; dropout is 0 in these configs
    return model


@pytest.fixture(scope="module")
def processor(tiny_vl_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vl_path)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2_path)


@dataclass
class Batch:
    prompt_ids: torch.Tensor  # (U, P) left-padded
    prompt_mask: torch.Tensor
    mm_token_type_ids: torch.Tensor | None  # (U, P), None for text-only LMs
    per_prompt_vision: list[dict]  # the processor's vision tensors of each prompt
    completion_ids: torch.Tensor  # (R, C) right-padded
    completion_mask: torch.Tensor
    row_to_prompt: torch.Tensor  # (R,)

    def vision(self, rows: list[int]) -> dict:
        """Vision inputs of the prompts `rows`, in that order (repeats give one copy per row, like TRL)."""
        out = {}
        for key in VISION_KEYS:
            parts = [self.per_prompt_vision[i][key] for i in rows if key in self.per_prompt_vision[i]]
            if parts:
                out[key] = torch.cat(parts)
        return out

    def prefix_inputs(self) -> dict:
        mm = {} if self.mm_token_type_ids is None else {"mm_token_type_ids": self.mm_token_type_ids}
        return dict(**self.vision(list(range(len(self.per_prompt_vision)))), **mm)

    def select_rows(self, rows: torch.Tensor) -> Batch:
        return Batch(self.prompt_ids, self.prompt_mask, self.mm_token_type_ids, self.per_prompt_vision,
                     self.completion_ids[rows], self.completion_mask[rows], self.row_to_prompt[rows])


def _chat(processor, kind, text):
    content = ([] if kind == "text" else [{"type": kind}]) + [{"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def _process(processor, kind, seed):
    """One prompt through the real processor. 'video_long' (16 frames, 56x56, short question) is a video whose
    time-scaled temporal positions run past every text position after it, so max(prompt positions) + 1 is not where
    the completion starts; 'video' is 4 frames of 56x84."""
    from transformers.video_utils import VideoMetadata

    rng = np.random.default_rng(seed)
    question = " ".join(["How many red balls move left?", "Which object appeared first?"][: 1 + seed % 2])
    if kind.startswith("video"):
        num_frames, width, question = (16, 56, "Why?") if kind == "video_long" else (4, 84, question)
        frames = torch.from_numpy(rng.integers(0, 255, (num_frames, 3, 56, width), dtype=np.uint8))
        meta = VideoMetadata(total_num_frames=num_frames, fps=2.0, frames_indices=list(range(num_frames)))
        return processor(text=[_chat(processor, "video", question)], videos=[frames], return_tensors="pt",
                         videos_kwargs=dict(video_metadata=[meta], do_sample_frames=False))
    if kind == "image":
        image = Image.fromarray(rng.integers(0, 255, (56, 84 if seed % 2 else 56, 3), dtype=np.uint8))
        return processor(text=[_chat(processor, "image", question)], images=[image], return_tensors="pt")
    return processor(text=[_chat(processor, "text", question + " Answer briefly" * (1 + seed % 3))],
                     return_tensors="pt")


def _left_pad(seqs, pad_id):
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), P, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, P - len(s):] = s
        mask[i, P - len(s):] = 1
    return ids, mask


def _completions(U, G, seed, max_len=6, low=10, high=700):
    """G right-padded completions per prompt of varied lengths (ids avoid the special/vision tokens 0-6)."""
    gen = torch.Generator().manual_seed(seed)
    R = U * G
    lengths = torch.randint(1, max_len + 1, (R,), generator=gen)
    lengths[0] = max_len  # some row uses the full width
    ids = torch.randint(low, high, (R, max_len), generator=gen)
    mask = (torch.arange(max_len) < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask, torch.arange(U).repeat_interleave(G)


def vl_batch(processor, kinds, G, seed=0) -> Batch:
    processed = [_process(processor, kind, seed + i) for i, kind in enumerate(kinds)]
    prompt_ids, prompt_mask = _left_pad([p["input_ids"][0] for p in processed], processor.tokenizer.pad_token_id)
    mm, _ = _left_pad([p["mm_token_type_ids"][0] for p in processed], 0)
    vision = [{k: p[k] for k in VISION_KEYS if k in p} for p in processed]
    completion_ids, completion_mask, rows = _completions(len(kinds), G, seed)
    return Batch(prompt_ids, prompt_mask, mm, vision, completion_ids, completion_mask, rows)


def text_batch(tokenizer, G, seed=0) -> Batch:
    texts = ["count to three", "what is the colour of the sky in the video please tell me now", "left or right"]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                           add_generation_prompt=True) for t in texts]
    prompt_ids, prompt_mask = _left_pad([torch.tensor(tokenizer(c)["input_ids"]) for c in chats],
                                        tokenizer.pad_token_id)
    completion_ids, completion_mask, rows = _completions(len(texts), G, seed)
    return Batch(prompt_ids, prompt_mask, None, [{} for _ in texts], completion_ids, completion_mask, rows)


KINDS = {
    "video": ["video_long", "video"],
    "image": ["image", "image"],
    "mixed": ["video_long", "image"],
    "text_vl": ["text", "text"],
}


# ----------------------------------------------------------------------------------------------------------------
# References (the full forward) and the prefix/suffix path
# ----------------------------------------------------------------------------------------------------------------


def full_inputs(b: Batch) -> dict:
    rows = b.row_to_prompt
    inputs = dict(input_ids=torch.cat([b.prompt_ids[rows], b.completion_ids], 1),
                  attention_mask=torch.cat([b.prompt_mask[rows], b.completion_mask], 1), **b.vision(rows.tolist()))
    if b.mm_token_type_ids is not None:
        inputs["mm_token_type_ids"] = torch.cat([b.mm_token_type_ids[rows], torch.zeros_like(b.completion_ids)], 1)
    return inputs


def full_plain(model, b: Batch, temperature=TEMPERATURE):
    """Plain full forward, then log_softmax(logits / T) and gather; padded completion positions zeroed (TRL's
    contract). Run on a model without the fused patch (or with it: without fused_lm_head the forward is HF's)."""
    C = b.completion_ids.size(1)
    logits = model(**full_inputs(b), use_cache=False, logits_to_keep=C + 1).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float() / temperature, -1)
    pad = b.completion_mask == 0
    logps = logprobs.gather(-1, b.completion_ids.unsqueeze(-1)).squeeze(-1).masked_fill(pad, 0)
    entropy = -(logprobs.exp() * logprobs).sum(-1).masked_fill(pad, 0)
    return logps, entropy


def full_trl(fused_model, b: Batch):
    """TRL's `_get_per_token_logps_and_entropies` (GRPO 1.16) on one batch: fused head, labels on completions."""
    inputs = full_inputs(b)
    C = b.completion_ids.size(1)
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    labels[:, :-C] = -100
    out = fused_model(**inputs, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -C:], out.entropy[:, -C:]


def split(model, b: Batch, keep_graph=False, state: PrefixState | None = None):
    state = state or prefix_forward(model, b.prompt_ids, b.prompt_mask, **b.prefix_inputs(), keep_graph=keep_graph)
    return suffix_logps(model, state, b.row_to_prompt, b.completion_ids, b.completion_mask,
                        temperature=TEMPERATURE, compute_entropy=True)


def max_diff(a, b):
    return (a - b).abs().max().item()


def pg_loss(logps, b: Batch, adv):
    """GRPO-like loss: -(logp * mask * A).sum() / mask.sum() with random advantages."""
    mask = b.completion_mask.float()
    return -(logps * mask * adv).sum() / mask.sum()


def advantages(b: Batch, seed=1):
    return torch.randn(b.completion_ids.size(0), 1, generator=torch.Generator().manual_seed(seed))


def grads_of(model) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_grads_match(ref: dict, got: dict, rtol=GRAD_RTOL) -> float:
    """Every parameter: max|g_ref - g| / max|g_ref| <= rtol (both absent/zero where the reference has none)."""
    assert ref.keys() == got.keys()
    worst = 0.0
    for name, g_ref in ref.items():
        g = got[name]
        if g_ref is None or g_ref.abs().max() == 0:
            assert g is None or g.abs().max() == 0, f"{name}: reference has no gradient, prefix path has one"
            continue
        assert g is not None, f"{name}: no gradient on the prefix path"
        rel = ((g_ref - g).abs().max() / g_ref.abs().max()).item()
        assert rel <= rtol, f"{name}: relative grad diff {rel:.3e}"
        worst = max(worst, rel)
    return worst


def assert_vision_grads_nonzero(grads: dict):
    vision = {n: g for n, g in grads.items() if ".visual." in n}
    assert vision, "no vision-tower parameters found"
    for name, g in vision.items():
        assert g is not None and g.abs().max() > 0, f"vision parameter {name} got no gradient"


# ----------------------------------------------------------------------------------------------------------------
# Log-probs and entropies (no grad: old/ref passes)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("G", [1, 8])
@pytest.mark.parametrize("kind", list(KINDS))
def test_vl_logps_match_full_forward(tiny_vl_path, processor, kind, G, attn):
    b = vl_batch(processor, KINDS[kind], G)
    assert b.prompt_mask[:, 0].min() == 0, "prompts of different lengths (left padding)"
    plain = load_vl(tiny_vl_path, attn)
    fused = load_vl(tiny_vl_path, attn, fused=True)
    with torch.no_grad():
        ref_lp, ref_ent = full_plain(plain, b)
        trl_lp, trl_ent = full_trl(fused, b)
        lp, ent = split(plain, b)  # our own log_softmax head
        flp, fent = split(fused, b)  # TRL's fused head on the suffix
    assert lp.shape == ent.shape == b.completion_ids.shape
    assert max_diff(lp, ref_lp) <= LOGP_TOL and max_diff(ent, ref_ent) <= LOGP_TOL
    assert max_diff(flp, trl_lp) <= LOGP_TOL and max_diff(fent, trl_ent) <= LOGP_TOL
    assert max_diff(flp, ref_lp) <= LOGP_TOL  # the two references agree too
    assert (lp[b.completion_mask == 0] == 0).all() and (flp[b.completion_mask == 0] == 0).all()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("G", [1, 8])
def test_text_qwen2_logps_match_full_forward(tiny_qwen2_path, tokenizer, G, attn):
    b = text_batch(tokenizer, G)
    plain = load_qwen2(tiny_qwen2_path, attn)
    fused = load_qwen2(tiny_qwen2_path, attn, fused=True)
    with torch.no_grad():
        ref_lp, ref_ent = full_plain(plain, b)
        trl_lp, trl_ent = full_trl(fused, b)
        state = prefix_forward(plain, b.prompt_ids, b.prompt_mask)
        lp, ent = split(plain, b, state=state)
        flp, fent = split(fused, b, state=state)  # same weights: one prefix serves both heads
    assert state.last_positions.shape == (b.prompt_ids.size(0),)  # 1-D RoPE: one position per prompt
    assert max_diff(lp, ref_lp) <= LOGP_TOL and max_diff(ent, ref_ent) <= LOGP_TOL
    assert max_diff(flp, trl_lp) <= LOGP_TOL and max_diff(fent, trl_ent) <= LOGP_TOL


# ----------------------------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------------------------


def _grad_case(model, b: Batch, mode: str, fused_ref: bool):
    """(reference grads, prefix-path grads, prefix-path log-probs, reference log-probs) for pg_loss on `b`."""
    adv = advantages(b)
    model.zero_grad()
    ref_lp = full_trl(model, b)[0] if fused_ref else full_plain(model, b)[0]
    pg_loss(ref_lp, b, adv).backward()
    ref = grads_of(model)

    model.zero_grad()
    state = prefix_forward(model, b.prompt_ids, b.prompt_mask, **b.prefix_inputs(), keep_graph=True)
    if mode == "single":  # the suffix attends to the graph-carrying K/V: one backward through everything
        lp, _ = split(model, b, state=state)
        pg_loss(lp, b, adv).backward()
    else:  # two-stage: suffix backward into leaf K/V, then one backward through the prompt forward
        leaf_state, outputs = detach_prefix(state)
        lp, _ = split(model, b, state=leaf_state)
        pg_loss(lp, b, adv).backward()
        backward_prefix(outputs, leaf_state)
    return ref, grads_of(model), lp.detach(), ref_lp.detach()


GRAD_CASES = [  # (kind, G, attn, fused head, checkpointing, backward mode); the rest of the product is slow
    ("mixed", 8, "eager", True, False, "single"),
    ("mixed", 8, "sdpa", True, True, "two_stage"),
    ("mixed", 8, "eager", False, True, "single"),
    ("video", 3, "eager", True, True, "single"),
    ("video", 3, "sdpa", False, False, "two_stage"),
    ("image", 3, "eager", True, False, "two_stage"),
    ("text_vl", 3, "eager", True, True, "two_stage"),
]
SLOW_GRAD_CASES = [
    (kind, G, attn, fused, ckpt, mode)
    for kind in KINDS for G in (1, 8) for attn in ("eager", "sdpa") for fused in (True, False)
    for ckpt in (False, True) for mode in ("single", "two_stage")
    if (kind, G, attn, fused, ckpt, mode) not in GRAD_CASES
]


@pytest.mark.parametrize(
    "kind,G,attn,fused,ckpt,mode",
    GRAD_CASES + [pytest.param(*case, marks=pytest.mark.slow) for case in SLOW_GRAD_CASES],
)
def test_vl_grads_match_full_forward(tiny_vl_path, processor, kind, G, attn, fused, ckpt, mode):
    b = vl_batch(processor, KINDS[kind], G)
    model = load_vl(tiny_vl_path, attn, fused=fused, checkpointing=ckpt)
    ref, got, lp, ref_lp = _grad_case(model, b, mode, fused_ref=fused)
    assert max_diff(lp, ref_lp) <= LOGP_TOL
    assert_grads_match(ref, got)
    if kind != "text_vl":
        assert_vision_grads_nonzero(got)


@pytest.mark.parametrize("fused,ckpt,mode", [(True, True, "single"), (False, False, "two_stage")])
def test_text_qwen2_grads_match_full_forward(tiny_qwen2_path, tokenizer, fused, ckpt, mode):
    b = text_batch(tokenizer, G=4)
    model = load_qwen2(tiny_qwen2_path, fused=fused, checkpointing=ckpt)
    ref, got, lp, ref_lp = _grad_case(model, b, mode, fused_ref=fused)
    assert max_diff(lp, ref_lp) <= LOGP_TOL
    assert_grads_match(ref, got)


def test_reentrant_checkpointing_still_exact(tiny_vl_path, processor):
    """Reentrant checkpointing cannot backprop into a cache; the prefix path turns it off for its decoder layers."""
    b = vl_batch(processor, KINDS["mixed"], G=3)
    model = _prepare(load_vl(tiny_vl_path), fused=True, checkpointing=True, reentrant=True)
    model.enable_input_require_grads()  # what reentrant checkpointing needs for the full forward's own gradients
    ref, got, lp, ref_lp = _grad_case(model, b, "single", fused_ref=True)
    assert max_diff(lp, ref_lp) <= LOGP_TOL
    assert_grads_match(ref, got)
    assert all(layer.gradient_checkpointing for layer in model.model.language_model.layers)  # restored


@pytest.mark.parametrize("ckpt", [False, True])
def test_microbatches_two_stage_one_final_backward(tiny_vl_path, processor, ckpt):
    """Grad accumulation over micro-batches sharing one prefix: earlier micro-batches backprop into the leaves, the
    last one joins the prefix backward in a single autograd call. Rows of a micro-batch mix prompts."""
    b = vl_batch(processor, KINDS["mixed"], G=4)
    micro = [torch.tensor([0, 5, 2, 7]), torch.tensor([1, 4, 6]), torch.tensor([3])]
    parts = [b.select_rows(rows) for rows in micro]
    advs = [advantages(p, seed=i) for i, p in enumerate(parts)]
    model = load_vl(tiny_vl_path, fused=True, checkpointing=ckpt)

    model.zero_grad()
    for part, adv in zip(parts, advs):
        pg_loss(full_trl(model, part)[0], part, adv).backward()
    ref = grads_of(model)

    model.zero_grad()
    state = prefix_forward(model, b.prompt_ids, b.prompt_mask, **b.prefix_inputs(), keep_graph=True)
    leaf_state, outputs = detach_prefix(state)
    for part, adv in zip(parts[:-1], advs[:-1]):
        pg_loss(split(model, part, state=leaf_state)[0], part, adv).backward()
    last_loss = pg_loss(split(model, parts[-1], state=state)[0], parts[-1], advs[-1])
    backward_prefix(outputs, leaf_state, loss=last_loss)
    got = grads_of(model)
    assert_grads_match(ref, got)
    assert_vision_grads_nonzero(got)
    assert all(t.grad is None for t in leaf_state.kv_tensors())  # released: cannot be applied twice
    # the per-call checkpointing override is gone again (other code passing caches must not inherit it)
    assert not any("_can_checkpoint_with_cache" in vars(layer) for layer in model.model.language_model.layers)


def test_peft_lora_adapter_on_and_off(tiny_vl_path, processor):
    """LoRA policy (adapter on) and reference (adapter off, `disable_adapter()`) both match their full forwards, and
    the LoRA gradients match, under gradient checkpointing with the fused head added before PEFT (as TRL does)."""
    from peft import LoraConfig, get_peft_model

    b = vl_batch(processor, KINDS["mixed"], G=3)
    base = load_vl(tiny_vl_path, fused=True, checkpointing=True)
    # init_lora_weights=False: random B, so that adapter on and off give different log-probs
    model = get_peft_model(base, LoraConfig(target_modules=["q_proj", "v_proj"], r=4, init_lora_weights=False))
    model.train()
    with torch.no_grad():
        on_ref, _ = full_trl(model, b)
        on, _ = split(model, b)
        with model.disable_adapter():
            off_ref, _ = full_trl(model, b)
            off, _ = split(model, b)
    assert max_diff(on_ref, off_ref) > 1e-3, "adapter should change the log-probs"
    assert max_diff(on, on_ref) <= LOGP_TOL
    assert max_diff(off, off_ref) <= LOGP_TOL

    for mode in ("single", "two_stage"):
        ref, got, lp, ref_lp = _grad_case(model, b, mode, fused_ref=True)
        assert max_diff(lp, ref_lp) <= LOGP_TOL
        assert all("lora_" in n for n in ref) and len(ref) > 0
        assert_grads_match(ref, got)


# ----------------------------------------------------------------------------------------------------------------
# Negative control, state, reuse, errors
# ----------------------------------------------------------------------------------------------------------------


def test_detached_prefix_gives_wrong_grads(tiny_vl_path, processor):
    """Without the prompt graph (a no_grad prefix), the log-probs are right but the gradients are not: the
    comparison above can fail, and the graph through the K/V is what makes it pass."""
    b = vl_batch(processor, KINDS["mixed"], G=3)
    model = load_vl(tiny_vl_path, fused=True)
    adv = advantages(b)
    model.zero_grad()
    pg_loss(full_trl(model, b)[0], b, adv).backward()
    ref = grads_of(model)
    model.zero_grad()
    state = prefix_forward(model, b.prompt_ids, b.prompt_mask, **b.prefix_inputs(), keep_graph=False)
    assert not state.has_graph
    lp, _ = split(model, b, state=state)
    pg_loss(lp, b, adv).backward()
    got = grads_of(model)
    with torch.no_grad():
        assert max_diff(lp, full_trl(model, b)[0]) <= LOGP_TOL
    with pytest.raises(AssertionError):
        assert_grads_match(ref, got)
    assert all(got[n] is None for n in got if ".visual." in n)
    with pytest.raises(ValueError, match="no autograd graph"):
        detach_prefix(state)


def test_state_layout_reuse_and_positions(tiny_vl_path, processor):
    b = vl_batch(processor, KINDS["mixed"], G=2)
    model = load_vl(tiny_vl_path, fused=True)
    cfg = model.config.text_config
    U, P = b.prompt_ids.shape
    seen_patches = []  # rows of pixel values entering the vision tower, per call
    model.model.visual.register_forward_hook(lambda module, args, out: seen_patches.append(args[0].size(0)))
    with torch.no_grad():
        state = prefix_forward(model, b.prompt_ids, b.prompt_mask, **b.prefix_inputs())
        # the vision tower ran once per unique prompt (one image call, one video call), not once per completion
        assert sum(seen_patches) == sum(v.size(0) for p in b.per_prompt_vision for k, v in p.items()
                                        if k.startswith("pixel_values")) and len(seen_patches) == 2
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        assert state.num_layers == cfg.num_hidden_layers == len(state.keys) == len(state.values)
        assert state.keys[0].shape == (U, cfg.num_key_value_heads, P - 1, head_dim)
        assert state.kv_bytes() == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * (P - 1) * U * 4
        assert state.last_positions.shape == (3, U) and state.last_token_ids.tolist() == b.prompt_ids[:, -1].tolist()
        # Read-only cache: passes do not grow or change the state, so they can be repeated and reordered
        before = [k.clone() for k in state.keys]
        first = split(model, b, state=state)
        perm = torch.randperm(b.completion_ids.size(0), generator=torch.Generator().manual_seed(0))
        permuted = split(model, b.select_rows(perm), state=state)
        again = split(model, b, state=state)
    assert all(torch.equal(k, k0) for k, k0 in zip(state.keys, before))
    assert torch.equal(first[0], again[0]) and max_diff(first[0][perm], permuted[0]) <= LOGP_TOL
    # The long video's temporal positions run past the text after it: the completion continues from the last prompt
    # token's position; max(prompt positions) + 1 is off, and changes the log-probs
    max_positions = state.last_positions.clone()
    grids = {k: v for k, v in b.prefix_inputs().items() if k.endswith("grid_thw") or k == "second_per_grid_ts"}
    positions, _ = model.model.get_rope_index(b.prompt_ids, b.mm_token_type_ids, **grids, attention_mask=b.prompt_mask)
    max_positions[:, 0] = positions[:, 0].max()
    assert (max_positions[:, 0] > state.last_positions[:, 0]).all()
    with torch.no_grad():
        shifted = split(model, b, state=dataclasses.replace(state, last_positions=max_positions))
    rows = b.row_to_prompt == 0
    assert max_diff(shifted[0][rows], first[0][rows]) > 1e-4


def test_errors(tiny_vl_path, processor):
    b = vl_batch(processor, KINDS["image"], G=1)
    model = load_vl(tiny_vl_path, fused=True)
    with torch.no_grad():
        state = prefix_forward(model, b.prompt_ids, b.prompt_mask, **b.prefix_inputs())
        with pytest.raises(ValueError, match="temperature"):
            suffix_logps(model, state, b.row_to_prompt, b.completion_ids, b.completion_mask, temperature=1.0)
        right_padded = torch.cat([b.prompt_mask[:, 1:], torch.zeros_like(b.prompt_mask[:, :1])], 1)
        with pytest.raises(ValueError, match="left-padded"):
            prefix_forward(model, b.prompt_ids, right_padded, **b.prefix_inputs())


def test_a_decoder_that_ignores_the_cache_is_refused(tiny_qwen2_path, tokenizer, monkeypatch):
    """A transformers version that drops or renames the cache argument (5.19 took it as `past_key_values`, and HF
    models swallow unknown keyword arguments) would give a suffix attending to itself only: wrong log-probs without
    any error. Both halves must notice instead."""
    import rollplex_trl.prefix.forward as forward_module

    model = load_qwen2(tiny_qwen2_path)
    b = text_batch(tokenizer, G=2)
    state = prefix_forward(model, b.prompt_ids, b.prompt_mask)
    monkeypatch.setattr(forward_module, "cache_kwarg", lambda module: "a_keyword_the_model_ignores")
    with pytest.raises(RuntimeError, match="did not use the prompt's KV cache"):
        prefix_forward(model, b.prompt_ids, b.prompt_mask)
    with pytest.raises(RuntimeError, match="did not use the prompt's KV cache"):
        suffix_logps(model, state, b.row_to_prompt, b.completion_ids, b.completion_mask)

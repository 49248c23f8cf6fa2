"""The prefix/suffix split on a second vision-language family, Qwen3-VL (transformers' `qwen3_vl`), at the model
level: its DeepStack (the tower's per-block features added to the LLM's first layers), the timestamps its processor
writes between temporal patches, its interleaved M-RoPE and its 16-pixel patches.

Each is compared with Qwen3-VL's own full forward: the per-token log-probs and entropies (fp32, and bf16 autocast),
the gradients of every parameter (vision tower and DeepStack mergers included), the shared-prefill generation
against `generate`, and the patch-shuffle feature reuse with the DeepStack features permuted too. The trainer on
Qwen3-VL: tests/test_qwen3_vl_trainer.py.
"""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, Qwen3VLForConditionalGeneration
from transformers.video_utils import VideoMetadata

from rollplex_trl.data.prompt import prepare_prompt
from rollplex_trl.data.video import SampledVideo
from rollplex_trl.prefix import prefix_forward, suffix_logps
from rollplex_trl.prefix.batch import run_prefix
from rollplex_trl.prefix.generation import generate_with_shared_prefill
from rollplex_trl.prefix.vision_reuse import VideoFeatureStore
from rollplex_trl.temporal import shuffled_prompt

TEMPERATURE = 0.7
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
KINDS = {"video": (8, 64, 96), "video_small": (4, 64, 64)}


@pytest.fixture(scope="module")
def qwen3_vl(checkpoint_cache):
    from rollplex_trl.testing.checkpoints import get_checkpoint

    path = get_checkpoint("qwen3_vl", "tiny", cache_dir=checkpoint_cache)
    return path, AutoProcessor.from_pretrained(path)


def _model(path):
    return Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).train()  # no dropout


def _frames(n, h, w, seed):
    return torch.randint(0, 255, (n, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _processed(processor, kind, seed):
    content = [{"type": "text", "text": ["which way does it move?", "what appeared first?"][seed % 2]}]
    call = {"return_tensors": "pt"}
    if kind in KINDS:
        n, h, w = KINDS[kind]
        content.insert(0, {"type": "video"})
        call.update(videos=[_frames(n, h, w, seed)], videos_kwargs={
            "video_metadata": [VideoMetadata(total_num_frames=n, fps=2.0, frames_indices=list(range(n)))],
            "do_sample_frames": False})
    else:
        content.insert(0, {"type": "image"})
        call["images"] = [Image.fromarray(np.random.default_rng(seed).integers(0, 255, (64, 96, 3), np.uint8))]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return processor(text=[text], **call)


def _left_pad(rows, pad):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def _batch(processor, kinds, G, C=6, seed=0):
    """Prompts of `kinds` (left-padded), G completions each of random tokens and lengths 1..C."""
    out = [_processed(processor, kind, seed + i) for i, kind in enumerate(kinds)]
    ids, mask = _left_pad([o["input_ids"][0] for o in out], processor.tokenizer.pad_token_id)
    types, _ = _left_pad([o["mm_token_type_ids"][0] for o in out], 0)
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(len(kinds)).repeat_interleave(G)
    lengths = torch.randint(1, C + 1, (rows.numel(),), generator=gen)
    lengths[0] = C
    completion_mask = (torch.arange(C) < lengths[:, None]).long()
    completions = torch.randint(10, 700, (rows.numel(), C), generator=gen).masked_fill(completion_mask == 0, 0)
    vision = [{k: o[k] for k in VISION_KEYS if k in o} for o in out]
    return dict(ids=ids, mask=mask, types=types, vision=vision, rows=rows, completions=completions,
                completion_mask=completion_mask)


def _vision(b, prompts):
    out = {}
    for key in VISION_KEYS:
        parts = [b["vision"][p][key] for p in prompts if key in b["vision"][p]]
        if parts:
            out[key] = torch.cat(parts)
    return out


def _full(model, b):
    """Per-token log-probs and entropies of the completions from one plain forward of the whole rows."""
    r, C = b["rows"], b["completions"].size(1)
    logits = model(input_ids=torch.cat([b["ids"][r], b["completions"]], 1),
                   attention_mask=torch.cat([b["mask"][r], b["completion_mask"]], 1),
                   mm_token_type_ids=torch.cat([b["types"][r], torch.zeros_like(b["completions"])], 1),
                   use_cache=False, logits_to_keep=C + 1, **_vision(b, r.tolist())).logits[:, :-1]
    logps = torch.log_softmax(logits.float() / TEMPERATURE, -1)
    pad = b["completion_mask"] == 0
    return (logps.gather(-1, b["completions"][..., None])[..., 0].masked_fill(pad, 0),
            (-(logps.exp() * logps).sum(-1)).masked_fill(pad, 0))


def _split(model, b, keep_graph=False):
    state = prefix_forward(model, b["ids"], b["mask"], mm_token_type_ids=b["types"], keep_graph=keep_graph,
                           **_vision(b, list(range(b["ids"].size(0)))))
    return suffix_logps(model, state, b["rows"], b["completions"], b["completion_mask"], temperature=TEMPERATURE,
                        compute_entropy=True)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_prefix_and_suffix_equal_the_full_forward(qwen3_vl, bf16):
    path, processor = qwen3_vl
    model = _model(path)
    b = _batch(processor, ["video", "video_small", "image"], G=3)
    assert (b["types"] == 2).sum() > 0 and b["ids"].size(1) > 40
    context = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    with torch.no_grad(), context:
        ref_logps, ref_entropy = _full(model, b)
        logps, entropy = _split(model, b)
    tolerance = 5e-2 if bf16 else 1e-5
    assert (logps - ref_logps).abs().max() <= tolerance
    assert (entropy - ref_entropy).abs().max() <= tolerance * 10
    # the check can fail: without DeepStack's injections into the LLM the log-probs move (0.12 in the probe)
    deepstack = model.model.language_model._deepstack_process
    model.model.language_model._deepstack_process = lambda hidden_states, *args, **kwargs: hidden_states
    try:
        with torch.no_grad():
            broken, _ = _split(model, b)
    finally:
        model.model.language_model._deepstack_process = deepstack
    assert (broken - ref_logps).abs().max() > 1e-2


def test_gradients_equal_the_full_forward(qwen3_vl):
    path, processor = qwen3_vl
    model = _model(path)
    b = _batch(processor, ["video", "video_small"], G=3)
    advantages = torch.randn(b["rows"].numel(), 1, generator=torch.Generator().manual_seed(1))
    weights = b["completion_mask"].float()

    def grads(logps):
        model.zero_grad()
        (-(logps * weights * advantages).sum() / weights.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference = grads(_full(model, b)[0])
    ours = grads(_split(model, b, keep_graph=True)[0])
    assert set(reference) == set(ours)
    assert any("deepstack_merger" in n for n in reference) and any("visual.blocks" in n for n in reference)
    for name, g in reference.items():
        scale = g.abs().max()
        assert scale == 0 or (ours[name] - g).abs().max() / scale <= 1e-4, name


def test_shared_prefill_generates_what_generate_does(qwen3_vl):
    path, processor = qwen3_vl
    model = _model(path).eval()
    rows = [prepare_prompt(processor, [{"role": "user", "content": [{"type": "video"}, {"type": "text",
                                                                                           "text": q}]}],
                           sample_id=str(i), videos=[SampledVideo(frames=_frames(n, h, w, i), sample_fps=2.0,
                                                                  source="<frames>", video_fps=2.0, total_frames=n,
                                                                  frame_indices=list(range(n)))])
            for i, ((n, h, w), q) in enumerate(zip(KINDS.values(), ["left?", "first?"], strict=True))]
    rows = [r for r in rows for _ in range(2)]  # two samples of each prompt, as TRL repeats them
    ids, mask = _left_pad([torch.tensor(r.prompt_ids) for r in rows], processor.tokenizer.pad_token_id)
    types, _ = _left_pad([torch.tensor(r.mm_token_type_ids) for r in rows], 0)
    vision = {"pixel_values_videos": torch.cat([r.pixel_values_videos for r in rows]),
              "video_grid_thw": torch.cat([r.video_grid_thw for r in rows]), "mm_token_type_ids": types}
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id)
    with torch.no_grad():
        plain = model.generate(input_ids=ids, attention_mask=mask, **vision, **kwargs)
        shared = generate_with_shared_prefill(model, ids, mask, rows, num_generations=2, **vision, **kwargs)
    assert plain.size(1) > ids.size(1) and torch.equal(plain, shared)


def test_patch_shuffle_reuses_the_deepstack_features_too(qwen3_vl):
    """Qwen3-VL's tower encodes each temporal patch on its own, DeepStack levels included: the shuffled copy's
    prefill with the ordered clip's features permuted equals the prefill of its pixels, without the tower."""
    path, processor = qwen3_vl
    model = _model(path).eval()
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "which way?"}]}]
    ordered = [prepare_prompt(processor, messages, sample_id="a", videos=[SampledVideo(
        frames=_frames(8, 64, 96, 3), sample_fps=2.0, source="<frames>", video_fps=2.0, total_frames=8,
        frame_indices=list(range(8)))])]
    copy, how = shuffled_prompt(ordered[0], seed=1, step=2, granularity="patch")
    assert not torch.equal(how.permutations[0], torch.arange(how.permutations[0].numel()))
    pad = processor.tokenizer.pad_token_id

    def prefill(rows, store=None):
        ids, mask = _left_pad([torch.tensor(r.prompt_ids) for r in rows], pad)
        with torch.no_grad():
            return run_prefix(model, ids, mask, rows, keep_graph=False, generate_positions=True, video_store=store)

    plain = prefill([copy])
    store = VideoFeatureStore()
    prefill(ordered, store)
    assert len(store.features[(ordered[0].prompt_key, 0)].deepstack) == 2
    store.derive(copy, ordered[0], how.permutations)
    calls = []
    hook = model.model.visual.register_forward_hook(lambda *args: calls.append(1))
    try:
        reused = prefill([copy], store)
    finally:
        hook.remove()
    assert calls == [] and store.reused == 1
    for a, b in zip(reused.keys + reused.values, plain.keys + plain.values, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

"""Inputs for the checks every vision-language family passes (tests/models/test_family_contract.py) and
the family-specific ones (tests/prefix/test_qwen3_vl.py): processed video and image prompts, left-padded, with G
random completions each, and the reference computation they are compared with (one plain forward of whole rows)."""

import numpy as np
import torch
from PIL import Image
from transformers.video_utils import VideoMetadata

from rollplex_trl.prefix import prefix_forward, suffix_logps

TEMPERATURE = 0.7
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
KINDS = {"video": (8, 64, 96), "video_small": (4, 64, 64)}


def frames(n, h, w, seed):
    return torch.randint(0, 255, (n, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def processed(processor, kind, seed):
    content = [{"type": "text", "text": ["which way does it move?", "what appeared first?"][seed % 2]}]
    call = {"return_tensors": "pt"}
    if kind in KINDS:
        n, h, w = KINDS[kind]
        content.insert(0, {"type": "video"})
        call.update(videos=[frames(n, h, w, seed)], videos_kwargs={
            "video_metadata": [VideoMetadata(total_num_frames=n, fps=2.0, frames_indices=list(range(n)))],
            "do_sample_frames": False})
    else:
        content.insert(0, {"type": "image"})
        call["images"] = [Image.fromarray(np.random.default_rng(seed).integers(0, 255, (64, 96, 3), np.uint8))]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return processor(text=[text], **call)


def left_pad(rows, pad):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def scoring_batch(processor, kinds, G, C=6, seed=0):
    """Prompts of `kinds` (left-padded), G completions each of random tokens and lengths 1..C."""
    out = [processed(processor, kind, seed + i) for i, kind in enumerate(kinds)]
    ids, mask = left_pad([o["input_ids"][0] for o in out], processor.tokenizer.pad_token_id)
    types, _ = left_pad([o["mm_token_type_ids"][0] for o in out], 0)
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(len(kinds)).repeat_interleave(G)
    lengths = torch.randint(1, C + 1, (rows.numel(),), generator=gen)
    lengths[0] = C
    completion_mask = (torch.arange(C) < lengths[:, None]).long()
    completions = torch.randint(10, 700, (rows.numel(), C), generator=gen).masked_fill(completion_mask == 0, 0)
    vision = [{k: o[k] for k in VISION_KEYS if k in o} for o in out]
    return dict(ids=ids, mask=mask, types=types, vision=vision, rows=rows, completions=completions,
                completion_mask=completion_mask)


def vision_of(b, prompts):
    out = {}
    for key in VISION_KEYS:
        parts = [b["vision"][p][key] for p in prompts if key in b["vision"][p]]
        if parts:
            out[key] = torch.cat(parts)
    return out


def full_forward(model, b):
    """Per-token log-probs and entropies of the completions from one plain forward of the whole rows."""
    r, C = b["rows"], b["completions"].size(1)
    logits = model(input_ids=torch.cat([b["ids"][r], b["completions"]], 1),
                   attention_mask=torch.cat([b["mask"][r], b["completion_mask"]], 1),
                   mm_token_type_ids=torch.cat([b["types"][r], torch.zeros_like(b["completions"])], 1),
                   use_cache=False, logits_to_keep=C + 1, **vision_of(b, r.tolist())).logits[:, :-1]
    logps = torch.log_softmax(logits.float() / TEMPERATURE, -1)
    pad = b["completion_mask"] == 0
    return (logps.gather(-1, b["completions"][..., None])[..., 0].masked_fill(pad, 0),
            (-(logps.exp() * logps).sum(-1)).masked_fill(pad, 0))


def split_forward(model, b, keep_graph=False):
    state = prefix_forward(model, b["ids"], b["mask"], mm_token_type_ids=b["types"], keep_graph=keep_graph,
                           **vision_of(b, list(range(b["ids"].size(0)))))
    return suffix_logps(model, state, b["rows"], b["completions"], b["completion_mask"], temperature=TEMPERATURE,
                        compute_entropy=True)


def varied_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


def video_grpo_run(path, dataset, out_dir, on, **extra):
    """Three fp32 video GRPO steps (lr 5e-3, beta 0.1, 2 steps per generation) on the model at `path`, with the shared
    prefix, shared decode, the prefix jobs in a concurrent decode window, phase-aware memory (reference and optimizer
    state moved off between phases) and the audit every step `on`, or all of them off; the logged steps."""
    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

    mechanisms = dict(rollplex_share_prefix="on", rollplex_shared_decode="on", rollplex_overlap="on",
                      rollplex_memory="on", rollplex_verify_every=1) if on else \
        dict(rollplex_share_prefix="off", rollplex_shared_decode="off", rollplex_overlap="off", rollplex_memory="off",
             rollplex_verify_every=0)
    args = RollplexGRPOConfig(**{**dict(
        output_dir=str(out_dir), max_steps=3, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, learning_rate=5e-3, beta=0.1, logging_steps=1, report_to=[], seed=11, use_cpu=True,
        bf16=False, gradient_checkpointing=False, save_strategy="no", steps_per_generation=2,
        rollplex_video_min_pixels=4 * 32 * 32, rollplex_video_max_pixels=64 * 96), **mechanisms, **extra})
    trainer = RollplexGRPOTrainer(model=str(path), reward_funcs=varied_reward, args=args, train_dataset=dataset)
    trainer.train()
    return [r for r in trainer.state.log_history if "loss" in r]

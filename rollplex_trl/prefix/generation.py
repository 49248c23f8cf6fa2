"""Shared prefill for transformers' `generate`: each prompt's prefill runs once, its G samples decode from a copy.

TRL's transformers rollout calls `model.generate` on R = U*G rows, so the prompt (vision tower included) is
prefilled G times. Here `generate` is wrapped for the duration of TRL's call: the wrapper prefills the U unique
prompts once with `prefix_forward` (K/V of prompt[:, :-1], the same positions HF's own prefill uses), expands the
cache to the R rows, and lets HF's `generate` continue from it. HF then runs only the last prompt token before
sampling, exactly as when it continues generation from past key/values, so the sampling loop, its random draws and
TRL's post-processing are unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from transformers import DynamicCache

from rollplex_trl.data.prompt import PreparedPrompt
from rollplex_trl.prefix.batch import group_by_prompt, run_prefix
from rollplex_trl.prefix.forward import cache_kwarg, unwrap_model

_VISION_KWARGS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                  "mm_token_type_ids")


def _prefill_once(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  rows: Sequence[PreparedPrompt] | None) -> tuple[DynamicCache, torch.Tensor | None, int]:
    """Cache of prompt[:, :-1] for all R rows (computed for the unique prompts only) and the rows' M-RoPE deltas."""
    groups = group_by_prompt(input_ids, attention_mask, rows)
    first = groups.first_row
    unique_rows = [rows[r] for r in first] if rows is not None else None
    state = run_prefix(model, input_ids[first], attention_mask[first], unique_rows, keep_graph=False,
                       generate_positions=True)
    # run_prefix drops all-padding columns; the R rows keep TRL's width, so pad the cache back on the left.
    missing = input_ids.size(1) - state.prompt_length
    expand = groups.row_to_prompt
    layers = []
    for k, v in zip(state.keys, state.values):
        if missing:
            pad = k.new_zeros(k.size(0), k.size(1), missing, k.size(3))
            k, v = torch.cat([pad, k], dim=2), torch.cat([pad, v], dim=2)
        layers.append((k.index_select(0, expand), v.index_select(0, expand)))
    cache = DynamicCache(ddp_cache_data=layers)
    deltas = None
    if state.is_mrope:
        # HF's decode steps place token t of row r at `cumsum(mask) - 1 + rope_deltas[r]` on all three axes, with
        # rope_deltas = (position of the last prompt token) + 1 - (number of real prompt tokens).
        num_valid = attention_mask[first].sum(-1)
        deltas = (state.last_positions[0] + 1 - num_valid).index_select(0, expand).unsqueeze(-1)
    return cache, deltas, len(first)


@contextlib.contextmanager
def shared_prefill(model: torch.nn.Module, rows: Sequence[PreparedPrompt] | None,
                   on_prefill=None, decode_window=None) -> Iterator[None]:
    """Inside the block, `model.generate(input_ids, attention_mask, ...)` prefills each unique prompt once.

    `rows` are the generation batch's prepared prompts (None for text-only prompts, grouped by their tokens).
    `on_prefill(rows, unique_prompts)` is called after each shared prefill (for metrics). `decode_window(input_ids,
    attention_mask)`, a context manager factory, wraps the decoding itself (the overlap runs prefix work inside it).
    """
    causal_lm = unwrap_model(model)
    original = causal_lm.generate  # the bound method (instance attribute lookups fall back to the class)

    def generate(input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
        cache, deltas, unique = _prefill_once(causal_lm, input_ids, attention_mask, rows)
        for key in _VISION_KWARGS:  # all vision tokens are in the cache now: HF must not encode them again
            kwargs.pop(key, None)
        backbone = causal_lm.base_model
        if deltas is not None:
            backbone.rope_deltas = deltas
        if on_prefill is not None:
            on_prefill(input_ids.size(0), unique)
        window = decode_window(input_ids, attention_mask) if decode_window is not None else contextlib.nullcontext()
        with window:
            return original(input_ids=input_ids, attention_mask=attention_mask, **{cache_kwarg(causal_lm): cache},
                            **kwargs)

    causal_lm.generate = generate
    try:
        yield
    finally:
        del causal_lm.generate  # back to the class's method

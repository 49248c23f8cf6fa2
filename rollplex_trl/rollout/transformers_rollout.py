"""`TransformersRollout`: the trainer's transformers rollout engine, as `VLLMRollout` is its vLLM one.

`generate` does what TRL's regular-generation branch of `GRPOTrainer._generate_single_turn` does (left padding with
`pad_to_multiple_of`, multimodal fields as tensors, `_prepare_inputs`, TRL's generation context, `generate` with
TRL's generation config, the prompt sliced off, everything after the first EOS masked), with one difference: the
shared prefill (prefix/generation.py `generate_with_shared_prefill`) is called directly. Each unique prompt is
prefilled once, HF's `generate` decodes its G samples from that cache, inside the decode window. Nothing is
patched on the model. The samples are TRL's: the same sampling loop and random draws.

Every TRL internal goes through trl_compat.py, whose `TRL_REGULAR_GENERATION_SHA256` pins the branch re-implemented
here. Tool images, continuous batching and TRL's own image path are not here: the trainer calls TRL for those
(trainers/rollout.py `takes_shared_prefill`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rollplex_trl import trl_compat
from rollplex_trl.data.prompt import PreparedPrompt
from rollplex_trl.prefix.forward import unwrap_model
from rollplex_trl.prefix.generation import BackendPrefill, PrefillForActor, generate_with_shared_prefill
from rollplex_trl.prefix.vision_reuse import VideoFeatureStore
from rollplex_trl.rollout.sampled_logps import SampledLogps


class TransformersRollout:
    """The transformers rollout of one trainer (built once by `TrainerRollout`); it keeps no state between calls."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def generate(self, prompt_ids: list[list[int]], rows: list[PreparedPrompt] | None, num_generations: int, *,
                 multimodal_fields: dict, decode_window: Callable | None = None,
                 for_actor: PrefillForActor | None = None, on_prefill: Callable[[int, int], None] | None = None,
                 shared_decode: str = "off", compile_decode: str = "off",
                 decode_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 prefill: BackendPrefill | None = None, video_store: VideoFeatureStore | None = None,
                 sampled_logps: SampledLogps | None = None) -> list[list[int]]:
        """Completion ids per row (R rows: each prompt of `prompt_ids` as TRL repeats it). `rows`: the rows'
        prepared prompts (None: grouped by their tokens). `sampled_logps`: records the sampler's log-probs of the
        first rows' tokens (the exactness audit, rollout/sampled_logps.py). The other arguments are
        `generate_with_shared_prefill`'s; the prefill and the decode's forward run in the trainer's autocast
        (`accelerator.autocast`)."""
        t = self.trainer
        inputs = self._inputs(prompt_ids, multimodal_fields)
        input_ids, attention_mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
        recording = sampled_logps.recording if sampled_logps is not None else lambda model: contextlib.nullcontext()
        with trl_compat.generation_model(t) as model, recording(unwrap_model(model)):
            prompt_completion_ids = generate_with_shared_prefill(
                model, input_ids, attention_mask, rows, on_prefill=on_prefill, decode_window=decode_window,
                shared_decode=shared_decode, num_generations=num_generations, for_actor=for_actor,
                compile_decode=compile_decode, forward_context=t.accelerator.autocast, decode_context=decode_context,
                prefill=prefill, video_store=video_store, generation_config=trl_compat.generation_config(t),
                **inputs)
        if sampled_logps is not None:
            sampled_logps.finish(prompt_completion_ids[:, input_ids.size(1):])
        return self._completions(prompt_completion_ids[:, input_ids.size(1):])

    def _inputs(self, prompt_ids: list[list[int]], multimodal_fields: dict) -> dict[str, torch.Tensor]:
        """TRL's generate inputs: left-padded ids and mask, multimodal fields as tensors, on the trainer's device."""
        t = self.trainer
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        inputs = {"input_ids": trl_compat.pad_left(t, prompts, trl_compat.pad_token_id(t)),
                  "attention_mask": trl_compat.pad_left(t, [torch.ones_like(p) for p in prompts], 0)}
        for key, value in multimodal_fields.items():
            if isinstance(value, torch.Tensor):
                inputs[key] = value
            elif isinstance(value, list) and value and isinstance(value[0], list):  # per token: padded like the ids
                inputs[key] = trl_compat.pad_left(t, [torch.tensor(x) for x in value], 0)
            else:
                inputs[key] = torch.tensor(np.array(value))
        return trl_compat.prepare_generation_inputs(t, inputs)

    def _completions(self, completion_ids: torch.Tensor) -> list[list[int]]:
        """Each row's tokens up to and including its first EOS (all of them where it has none)."""
        device = completion_ids.device
        is_eos = torch.isin(completion_ids, torch.tensor(trl_compat.eos_token_ids(self.trainer), device=device))
        any_eos = is_eos.any(dim=1)
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
        eos_idx[any_eos] = is_eos.int().argmax(dim=1)[any_eos]
        positions = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1)
        mask = positions <= eos_idx.unsqueeze(1)
        return [c[m].tolist() for c, m in zip(completion_ids.cpu(), mask.cpu(), strict=True)]

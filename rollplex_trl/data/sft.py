"""Supervised cold start on Video-R1-format rows, with TRL's ``SFTTrainer``.

Video-R1 trains in two stages: a supervised fine-tune on answers in the ``<think>…</think><answer>…</answer>``
format (its Video-R1-CoT-165k set, reasoning written by a larger model), then GRPO. The main job reproduces that in
miniature: :func:`cold_start_target` writes the assistant turn of a row from its ground truth (a one-line
"reasoning" that names the option, then the answer), and :class:`VideoSFTCollator` turns rows into the model's
inputs exactly as the GRPO trainer prepares its prompts (same PyAV frame sampling, same chat template and
processor, ``rollplex_trl.data.prepared``), followed by the target tokens; the loss is on the target only.

    trainer = SFTTrainer(model=model, args=SFTConfig(..., remove_unused_columns=False,
                         dataset_kwargs={"skip_prepare_dataset": True}),
                         train_dataset=load_video_r1(annotations), processing_class=processor,
                         data_collator=VideoSFTCollator(processor, sampling))
"""

from __future__ import annotations

import json
from typing import Any

import torch

from rollplex_trl.data.errors import RollplexDataError, describe_sample
from rollplex_trl.data.prepared import PREPARED_KEY, MediaOptions, MediaPreparer
from rollplex_trl.data.prompt import PreparedPrompt, vision_inputs
from rollplex_trl.data.rewards import extract_answer
from rollplex_trl.data.video import VideoSamplingConfig

# Tokens whose label is ignored by the loss (torch's cross_entropy default, as in transformers).
IGNORE_INDEX = -100
# Qwen's end-of-turn token: the assistant turn ends with it, and generation stops on it.
END_OF_TURN = "<|im_end|>"


def option_text(row: dict[str, Any], letter: str) -> str:
    """The words of option ``letter`` ("B" -> "right" for "B. right"); the letter itself if the row has no options."""
    for option in row.get("options") or []:
        head, _, words = option.partition(".")
        if head.strip() == letter and words.strip():
            return words.strip()
    return letter


def cold_start_target(row: dict[str, Any]) -> str:
    """The assistant turn the cold start teaches: ``<think>{option words}</think><answer>{answer}</answer>``.

    Short on purpose: it teaches the format the GRPO rewards check and names the answer in words, and GRPO's
    completions stay short (fast rollouts on a CPU).

    Raises:
        RollplexDataError: the row's ``solution`` has no ``<answer>…</answer>``.
    """
    answer = extract_answer(row.get("solution") or "")
    if not answer:
        sample = describe_sample(row.get("problem_id"))
        raise RollplexDataError(f"{sample}: the solution {row.get('solution')!r} has no <answer>…</answer>; the cold "
                                "start needs the ground truth to write a target")
    return f"<think>{option_text(row, answer)}</think><answer>{answer}</answer>"


class VideoSFTCollator:
    """Builds a causal-LM batch from Video-R1-format rows: the prepared prompt, then the target and ``<|im_end|>``.

    Rows are right-padded; ``labels`` are ``IGNORE_INDEX`` on the prompt and the padding. Each row's prompt (frames
    decoded, processor run) is prepared once and kept, so epochs after the first decode nothing.
    """

    def __init__(self, processor: Any, sampling: VideoSamplingConfig, target=cold_start_target) -> None:
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.preparer = MediaPreparer(processor, MediaOptions(sampling=sampling, cache_size=0))
        self.target = target
        self._prepared: dict[str, PreparedPrompt] = {}

    def _prompt(self, row: dict[str, Any]) -> PreparedPrompt:
        key = json.dumps([row.get("video"), row.get("image"), row["prompt"]], sort_keys=True, default=str)
        if key not in self._prepared:
            prepared = self.preparer.prepare_row(dict(row), sample_id=describe_sample(row.get("problem_id")))
            self._prepared[key] = prepared[PREPARED_KEY]
        return self._prepared[key]

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        prompts = [self._prompt(row) for row in rows]
        targets = [self.tokenizer(self.target(row) + END_OF_TURN, add_special_tokens=False)["input_ids"]
                   for row in rows]
        length = max(p.num_prompt_tokens + len(t) for p, t in zip(prompts, targets, strict=True))
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros(len(rows), length, dtype=torch.long)
        token_types = torch.zeros(len(rows), length, dtype=torch.long)
        for i, (prompt, target) in enumerate(zip(prompts, targets, strict=True)):
            n, m = prompt.num_prompt_tokens, len(target)
            input_ids[i, :n] = torch.tensor(prompt.prompt_ids)
            input_ids[i, n:n + m] = torch.tensor(target)
            labels[i, n:n + m] = torch.tensor(target)
            attention_mask[i, :n + m] = 1
            token_types[i, :n] = torch.tensor(prompt.mm_token_type_ids)
        # mm_token_type_ids: Qwen2.5-VL's M-RoPE positions of the video tokens come from them.
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                "mm_token_type_ids": token_types, **vision_inputs(prompts)}

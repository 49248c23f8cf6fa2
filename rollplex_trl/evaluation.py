"""Held-out accuracy of a Qwen2.5-VL on Video-R1-format rows, asked exactly as in training.

Each row's prompt goes through the training path (PyAV frame sampling, chat template, processor:
:func:`rollplex_trl.inference.video_question_inputs`), the model answers with ``generate`` and Video-R1's
``accuracy_reward`` scores the answer. Greedy by default (one answer per row); ``samples=k`` with ``do_sample=True``
scores k answers per row at the rollout temperature, which is what the training reward measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rollplex_trl.data.rewards import accuracy_reward, format_reward
from rollplex_trl.data.video import VideoSamplingConfig
from rollplex_trl.inference import video_question_inputs


@dataclass(frozen=True)
class HeldoutScore:
    """Mean Video-R1 accuracy and format rewards over the answers, how many answers were scored, and their texts
    (row by row, ``samples`` per row)."""

    accuracy: float
    format: float
    answers: int
    texts: tuple[str, ...] = ()


def heldout_accuracy(model: Any, processor: Any, rows: Any, sampling: VideoSamplingConfig, *,
                     max_new_tokens: int, samples: int = 1, do_sample: bool = False,
                     temperature: float = 1.0, seed: int = 0) -> HeldoutScore:
    """Score ``model``'s answers to ``rows`` (a Video-R1 dataset or a list of its rows) with ``accuracy_reward``.

    The model is put in eval mode for the call and restored after. Sampling draws from its own generator state,
    seeded with ``seed`` (torch's global state is saved and restored): the same model gets the same score, and
    evaluating in the middle of a training run does not change that run's later samples. Raises
    ``RollplexDataError`` (naming the file) if a video cannot be read.
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return _score(model, processor, rows, sampling, max_new_tokens=max_new_tokens, samples=samples,
                      do_sample=do_sample, temperature=temperature)


def _score(model: Any, processor: Any, rows: Any, sampling: VideoSamplingConfig, *, max_new_tokens: int,
           samples: int, do_sample: bool, temperature: float) -> HeldoutScore:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    accuracy, formats, texts = [], [], []
    try:
        for row in rows:
            inputs = video_question_inputs(processor, row["video"], row["prompt"], sampling=sampling, device=device)
            generate_kwargs = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if do_sample else \
                dict(do_sample=False)
            with torch.no_grad():
                output = model.generate(**inputs, max_new_tokens=max_new_tokens, num_return_sequences=samples,
                                        **generate_kwargs)
            answers = processor.batch_decode(output[:, inputs["input_ids"].size(1):], skip_special_tokens=True)
            accuracy += accuracy_reward(answers, [row["solution"]] * samples, row["problem_type"],
                                        problem_id=[row.get("problem_id")] * samples)
            formats += format_reward(answers)
            texts += answers
    finally:
        model.train(was_training)
    n = len(accuracy)
    return HeldoutScore(accuracy=sum(accuracy) / max(1, n), format=sum(formats) / max(1, n), answers=n,
                        texts=tuple(texts))

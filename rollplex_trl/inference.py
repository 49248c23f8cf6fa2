"""Asking a (trained) Qwen2.5-VL about a video file, with the frames sampled exactly as in training.

transformers' processors load videos with torchcodec, which is not a dependency here (it does not install against
the torch builds this project uses). :func:`ask_about_video` therefore takes the training data path itself: the
package's PyAV loader samples the frames (Video-R1's qwen-vl-utils rules, ``rollplex_trl.data.video``) and
``MediaPreparer`` runs the chat template and the processor, as the trainer does for a dataset row with a ``video``
column. Same ``fps`` / ``max_frames`` / pixel bounds as the ``rollplex_video_*`` fields used in training, same
tokens, same pixels.

    from rollplex_trl.inference import ask_about_video
    print(ask_about_video(model, processor, "clip.mp4", "How many red objects are in the video?"))
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from rollplex_trl.data.prepared import PREPARED_KEY, MediaOptions, MediaPreparer
from rollplex_trl.data.prompt import generation_fields
from rollplex_trl.data.video import VideoSamplingConfig

Messages = list[dict[str, Any]]


def sampling_from_config(config: Any) -> VideoSamplingConfig:
    """The frame sampling of a training configuration (its ``rollplex_video_*`` fields)."""
    from rollplex_trl.config import rollplex_options

    options = rollplex_options(config)
    return VideoSamplingConfig(
        fps=options["rollplex_video_fps"], min_frames=options["rollplex_video_min_frames"],
        max_frames=options["rollplex_video_max_frames"], min_pixels=options["rollplex_video_min_pixels"],
        max_pixels=options["rollplex_video_max_pixels"])


def sampling_from_checkpoint(checkpoint: str | os.PathLike[str]) -> VideoSamplingConfig | None:
    """The frame sampling a checkpoint was trained with (`RollplexGRPOTrainer` records it in the model's config,
    key `rollplex_video_sampling`, on video runs), or None if it has none (not trained on video by this package)."""
    import json
    from dataclasses import fields

    from rollplex_trl.trainers.media import SAMPLING_CONFIG_KEY

    config_file = os.path.join(os.fspath(checkpoint), "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{config_file}: no such file; is {os.fspath(checkpoint)} a model checkpoint folder?")
    with open(config_file) as f:
        recorded = json.load(f).get(SAMPLING_CONFIG_KEY)
    if not recorded:
        return None
    known = {f.name for f in fields(VideoSamplingConfig)}
    return VideoSamplingConfig(**{k: v for k, v in recorded.items() if k in known})


def ask_checkpoint(checkpoint: str | os.PathLike[str], video_path: str | os.PathLike[str], question: str, *,
                   max_new_tokens: int = 128, **overrides: Any) -> tuple[str, VideoSamplingConfig, dict[str, Any]]:
    """Load a checkpoint (model and processor) and ask it about a video with the frame sampling it was trained with
    (`sampling_from_checkpoint`; the defaults if it recorded none). `overrides` (fps, min_frames, max_frames,
    min_pixels, max_pixels; None = keep) replace single fields. Returns (answer, the sampling used, the overrides
    that differ from the recorded sampling)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    recorded = sampling_from_checkpoint(checkpoint)
    base = recorded or VideoSamplingConfig()
    changed = {k: v for k, v in overrides.items() if v is not None and getattr(base, k) != v}
    sampling = replace(base, **changed)
    model = AutoModelForImageTextToText.from_pretrained(os.fspath(checkpoint)).eval()
    processor = AutoProcessor.from_pretrained(os.fspath(checkpoint))
    answer = ask_about_video(model, processor, video_path, question, sampling=sampling, max_new_tokens=max_new_tokens)
    return answer, sampling, changed


def _messages(question: str | Messages) -> Messages:
    """A plain question becomes one user turn with the video before the text (Video-R1's prompt layout); a message
    list (e.g. ``rollplex_trl.data.build_prompt(row)``, the exact training prompt) is used as given."""
    if isinstance(question, str):
        return [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    return question


def video_question_inputs(processor: Any, video_path: str | os.PathLike[str], question: str | Messages, *,
                          sampling: VideoSamplingConfig | None = None, chat_template_kwargs: dict | None = None,
                          device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The keyword arguments of ``model.generate`` for one question about one video, built by the training path.

    Raises:
        RollplexDataError: the video is missing or cannot be decoded (the message names the file).
    """
    options = MediaOptions(sampling=sampling or VideoSamplingConfig(), cache_size=0,
                           chat_template_kwargs=chat_template_kwargs)
    row = {"prompt": _messages(question), "video": os.fspath(video_path)}
    prepared = MediaPreparer(processor, options).prepare_row(row, sample_id=f"question about {os.fspath(video_path)}")
    prompt = prepared[PREPARED_KEY]
    fields = generation_fields([prompt])
    inputs: dict[str, torch.Tensor] = {
        "input_ids": torch.tensor([prompt.prompt_ids]),
        "attention_mask": torch.ones(1, prompt.num_prompt_tokens, dtype=torch.long),
        # per-token modality ids: Qwen2.5-VL's M-RoPE positions for the video tokens come from them
        "mm_token_type_ids": torch.tensor(fields.pop("mm_token_type_ids")),
        **fields,
    }
    return {k: v.to(device) for k, v in inputs.items()} if device is not None else inputs


def answer_token_ids(model: Any, inputs: dict[str, torch.Tensor], *, max_new_tokens: int = 128,
                     do_sample: bool = False, **generate_kwargs: Any) -> list[int]:
    """The generated token ids (without the prompt) for inputs from :func:`video_question_inputs`."""
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=do_sample, **generate_kwargs)
    return output[0, inputs["input_ids"].size(1):].tolist()


def ask_about_video(model: Any, processor: Any, video_path: str | os.PathLike[str], question: str | Messages, *,
                    sampling: VideoSamplingConfig | None = None, fps: float | None = None,
                    min_frames: int | None = None, max_frames: int | None = None, min_pixels: int | None = None,
                    max_pixels: int | None = None, max_new_tokens: int = 128, do_sample: bool = False,
                    chat_template_kwargs: dict | None = None, **generate_kwargs: Any) -> str:
    """Ask ``model`` a question about the video at ``video_path``; returns the decoded answer.

    Args:
        model: a Qwen2.5-VL model (e.g. ``trainer.model``, or loaded from a checkpoint the trainer saved).
        processor: its processor (``trainer.processing_class``).
        video_path: the video file (any container/codec FFmpeg reads).
        question: the question text (the video goes before it), or a full message list.
        sampling: frame sampling (e.g. :func:`sampling_from_config` of the training config); the keyword
            arguments ``fps`` ... ``max_pixels`` override single fields of it (names as the ``rollplex_video_*``
            fields). Default: ``VideoSamplingConfig()``, the training defaults.
        max_new_tokens, do_sample, generate_kwargs: passed to ``model.generate`` (greedy by default).

    Raises:
        RollplexDataError: the video file is missing or cannot be decoded.
    """
    overrides = {k: v for k, v in dict(fps=fps, min_frames=min_frames, max_frames=max_frames, min_pixels=min_pixels,
                                       max_pixels=max_pixels).items() if v is not None}
    sampling = replace(sampling or VideoSamplingConfig(), **overrides)
    device = next(model.parameters()).device
    inputs = video_question_inputs(processor, video_path, question, sampling=sampling,
                                   chat_template_kwargs=chat_template_kwargs, device=device)
    ids = answer_token_ids(model, inputs, max_new_tokens=max_new_tokens, do_sample=do_sample, **generate_kwargs)
    return processor.batch_decode([ids], skip_special_tokens=True)[0].strip()

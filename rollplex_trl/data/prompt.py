"""A prompt after the processor, prepared once and shared by its G completion rows.

TRL 1.16's GRPOTrainer handles images only: it never forwards `pixel_values_videos`, `video_grid_thw` or
`second_per_grid_ts`, so video prompts would get silently wrong log-probs. Rollplex runs the processor itself, once
per dataset prompt, and keeps the result in a `PreparedPrompt`. Every row of a generation batch points to the
`PreparedPrompt` of its prompt, so the per-row vision tensors travel through TRL's shuffling and micro-batch
splitting as one list entry per row, and each log-prob pass rebuilds exactly the tensors of its rows.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from trl import prepare_multimodal_messages

from rollplex_trl.data.errors import RollplexDataError
from rollplex_trl.data.video import SampledVideo
from rollplex_trl.models.families import video_resize_kwargs

# mm_token_type_ids values used by Qwen2.5-VL's get_rope_index.
TEXT_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN = 0, 1, 2

_prompt_counter = itertools.count()


def new_prompt_key() -> int:
    """A prompt identity no other `PreparedPrompt` of this process has (a derived copy's, e.g. T-GRPO's shuffled
    clip: the same tokens, other pixels)."""
    return next(_prompt_counter)

# Per-prompt tensors in the model's keyword names, concatenated over rows in row order for a forward pass.
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclass(eq=False)
class PreparedPrompt:
    """Token ids and vision tensors of one prompt (all of its images and videos), computed once.

    `eq=False` on purpose: identity is what groups the G rows of one prompt (`prompt_key` is also unique).
    """

    sample_id: str
    prompt_ids: list[int]
    mm_token_type_ids: list[int]
    pixel_values: torch.Tensor | None = None  # (sum of image patches, C*t*p*p)
    image_grid_thw: torch.Tensor | None = None  # (num_images, 3)
    pixel_values_videos: torch.Tensor | None = None  # (sum of video patches, C*t*p*p)
    video_grid_thw: torch.Tensor | None = None  # (num_videos, 3)
    second_per_grid_ts: torch.Tensor | None = None  # (num_videos,) seconds per temporal grid step (M-RoPE time)
    sources: tuple[str, ...] = ()  # the files or "<frames>" the vision inputs came from, for error messages
    prompt_key: int = field(default_factory=new_prompt_key)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_visual_tokens(self) -> int:
        return sum(1 for t in self.mm_token_type_ids if t != TEXT_TOKEN)

    def describe(self) -> str:
        where = f" ({', '.join(self.sources)})" if self.sources else ""
        return f"sample {self.sample_id}{where}"

    def __repr__(self) -> str:
        # Short on purpose: the object travels in the batch's `rollplex_prompt` column, and TRL prints a row's columns
        # (e.g. when every reward function returned None); the default repr would print every token id and a tensor.
        grids = [t.tolist() for t in (self.video_grid_thw, self.image_grid_thw) if t is not None]
        return (f"PreparedPrompt({self.describe()}, {self.num_prompt_tokens} tokens, {self.num_visual_tokens} visual"
                f"{', grid ' + str(grids) if grids else ''})")


def attach_media(messages: list[dict[str, Any]], num_images: int, num_videos: int, sample_id: str) -> list[dict]:
    """Return structured messages with exactly one placeholder part per image and per video.

    Images follow TRL's convention (`prepare_multimodal_messages`: placeholders are inserted before the first user
    text when the prompt has none). Videos follow the same rule with `{"type": "video"}` parts.
    """
    messages = [_drop_null_fields(m) for m in copy.deepcopy(messages)]
    try:
        messages = prepare_multimodal_messages(messages, images=[None] * num_images)
    except ValueError as err:
        raise RollplexDataError(f"sample {sample_id}: cannot attach {num_images} images to the prompt: {err}") from err
    image_parts = [p for m in messages for p in (m.get("content") or []) if p.get("type") == "image"]
    if len(image_parts) != num_images:
        raise RollplexDataError(
            f"sample {sample_id}: the prompt has {len(image_parts)} image placeholders but the row has {num_images} "
            "images. Give one {'type': 'image'} part per image, or none to have them inserted before the text."
        )
    for part in image_parts:  # the processor gets the pixels separately; the template only needs the part type
        part.pop("image", None)
    video_parts = [p for m in messages for p in (m.get("content") or []) if p.get("type") == "video"]
    if not video_parts and num_videos:
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise RollplexDataError(f"sample {sample_id}: the prompt has no user message to attach the video to.")
        first_user["content"] = [{"type": "video"} for _ in range(num_videos)] + list(first_user["content"])
    elif len(video_parts) != num_videos:
        raise RollplexDataError(
            f"sample {sample_id}: the prompt has {len(video_parts)} video placeholders but the row has {num_videos} "
            "videos. Give one {'type': 'video'} part per video, or none to have them inserted before the text."
        )
    for part in video_parts:
        part.pop("video", None)
    return messages


def _drop_null_fields(message: dict[str, Any]) -> dict[str, Any]:
    """Remove None-valued keys from content parts.

    Arrow-backed datasets give every content part the union of all parts' keys (a video part gains `"image": None`,
    `"text": None`). Qwen's chat template tests `'image' in content`, so such a video part would render as an image.
    """
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = [{k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
                              for part in content]
    return message


def prepare_prompt(
    processor,
    messages: list[dict[str, Any]],
    *,
    sample_id: str,
    images: list | None = None,
    videos: list[SampledVideo] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    video_pixel_bounds: tuple[int, int] | None = None,
) -> PreparedPrompt:
    """Run the chat template and the processor on one prompt and keep what the model needs.

    `videos` are already sampled (frames resized the way qwen-vl-utils does); the processor is told their sampling
    (fps, frame indices) so that `second_per_grid_ts` matches the clip, and is given pixel bounds that make its own
    resize a no-op, so the frames are never resampled twice.
    """
    images = list(images or [])
    videos = list(videos or [])
    structured = attach_media(messages, len(images), len(videos), sample_id)
    text = processor.apply_chat_template(
        structured, tokenize=False, add_generation_prompt=True, chat_template=chat_template,
        **(chat_template_kwargs or {}),
    )
    call: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
    if images:
        call["images"] = images
    if videos:
        from transformers.video_utils import VideoMetadata

        call["videos"] = [v.frames for v in videos]
        videos_kwargs: dict[str, Any] = {
            "video_metadata": [
                VideoMetadata(total_num_frames=v.total_frames, fps=v.video_fps, frames_indices=list(v.frame_indices))
                for v in videos
            ],
            "do_sample_frames": False,
        }
        if video_pixel_bounds is not None:
            videos_kwargs.update(video_resize_kwargs(processor, video_pixel_bounds))
        call["videos_kwargs"] = videos_kwargs
    try:
        out = processor(**call)
    except Exception as err:  # the processor's own messages do not name the sample
        raise RollplexDataError(f"sample {sample_id}: the processor failed on this prompt: {err}") from err

    prompt_ids = out["input_ids"][0].tolist()
    if "mm_token_type_ids" in out:
        mm_types = out["mm_token_type_ids"][0].tolist()
    else:  # processors without mm_token_type_ids: derive them from the placeholder tokens
        mm_types = _token_types_from_ids(processor, prompt_ids)
    second = out.get("second_per_grid_ts")
    return PreparedPrompt(
        sample_id=str(sample_id),
        prompt_ids=prompt_ids,
        mm_token_type_ids=mm_types,
        pixel_values=out.get("pixel_values"),
        image_grid_thw=out.get("image_grid_thw"),
        pixel_values_videos=out.get("pixel_values_videos"),
        video_grid_thw=out.get("video_grid_thw"),
        second_per_grid_ts=torch.as_tensor(second, dtype=torch.float32) if second is not None else None,
        sources=tuple(v.source for v in videos),
    )


def _token_types_from_ids(processor, prompt_ids: list[int]) -> list[int]:
    image_id = getattr(processor, "image_token_id", None)
    video_id = getattr(processor, "video_token_id", None)
    return [IMAGE_TOKEN if t == image_id else VIDEO_TOKEN if t == video_id else TEXT_TOKEN for t in prompt_ids]


# ----------------------------------------------------------------------------------------------------------------
# From rows to model inputs
# ----------------------------------------------------------------------------------------------------------------

def vision_inputs(rows: list[PreparedPrompt], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Concatenate the vision tensors of `rows` in row order (one copy per row, as the model expects)."""
    result: dict[str, torch.Tensor] = {}
    for key in VISION_KEYS:
        parts = [getattr(r, key) for r in rows if getattr(r, key) is not None]
        if parts:
            result[key] = torch.cat(parts).to(device) if device is not None else torch.cat(parts)
    return result


def token_type_ids(rows: list[PreparedPrompt], prompt_length: int, total_length: int,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """`mm_token_type_ids` of shape (rows, total_length) for left-padded prompts followed by completions."""
    out = torch.zeros(len(rows), total_length, dtype=torch.long)
    for i, row in enumerate(rows):
        n = row.num_prompt_tokens
        if n > prompt_length:
            raise ValueError(f"{row.describe()}: {n} prompt tokens do not fit the padded prompt of {prompt_length}")
        out[i, prompt_length - n : prompt_length] = torch.tensor(row.mm_token_type_ids)
    return out.to(device) if device is not None else out


def check_rows_match_ids(rows: list[PreparedPrompt], prompt_ids: torch.Tensor) -> None:
    """Fail loudly if the rows' prompts are not the prompts in `prompt_ids` (left-padded): a misaligned batch would
    put one sample's pixels under another sample's tokens and train on it without any error."""
    if len(rows) != prompt_ids.size(0):
        raise RuntimeError(f"internal error: {len(rows)} prepared prompts for a batch of {prompt_ids.size(0)} rows")
    width = prompt_ids.size(1)
    for i, row in enumerate(rows):
        n = row.num_prompt_tokens
        expected = torch.tensor(row.prompt_ids, device=prompt_ids.device)
        if n > width or not torch.equal(prompt_ids[i, width - n :], expected):
            raise RuntimeError(
                f"internal error: row {i} of the batch does not hold the prompt of {row.describe()}; refusing to "
                "compute log-probs with misaligned vision inputs"
            )


def generation_fields(rows: list[PreparedPrompt]) -> dict[str, Any]:
    """The `multimodal_fields` TRL's generate path expects: vision tensors per row and per-token type ids."""
    fields = vision_inputs(rows)
    fields["mm_token_type_ids"] = [list(r.mm_token_type_ids) for r in rows]
    return fields


def content_key(value: Any) -> Any:
    """A hashable key equal for equal content: nested dicts/lists by value, images and arrays by a digest of their
    bytes (the G copies of a prompt are separate objects after TRL's repeat and arrow round trips)."""
    if value is None or isinstance(value, (str, int, float, bool, bytes)):
        return value
    if isinstance(value, dict):
        return tuple(sorted((str(k), content_key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(content_key(v) for v in value)
    if hasattr(value, "tobytes"):  # PIL images, numpy arrays: by content
        shape = getattr(value, "shape", getattr(value, "size", ""))
        return ("bytes", hashlib.sha1(value.tobytes()).hexdigest(), str(shape))
    if isinstance(value, torch.Tensor):
        return content_key(value.numpy())
    return repr(value)


def prompt_identity(token_ids: Sequence[int], row: PreparedPrompt | None = None, images: Any = None) -> tuple:
    """What makes two rows the same prompt, everywhere (prefix grouping, vLLM requests): the same prepared prompt
    (video/image prompts: equal tokens can carry different pixels, so the object's `prompt_key` decides), else the
    same unpadded token ids and the same images by content (TRL's own image rows: the G copies are separate PIL
    objects)."""
    if row is not None:
        return ("prepared", row.prompt_key)
    return ("tokens", tuple(int(t) for t in token_ids), content_key(images) if images else None)

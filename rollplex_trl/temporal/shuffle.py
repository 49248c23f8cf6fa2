"""The shuffled copy of a video prompt (T-GRPO): the same tokens, the frames in another order.

Video-R1 permutes the sampled frames (`torch.randperm` over the clip's frames) and runs the processor again. The
processor's work on a frame (resize, rescale, normalise) does not depend on the other frames, so permuting the
*processed* tensor's frames gives exactly the processor's output on the permuted frames, without decoding or
processing anything again (tests/temporal/test_shuffle.py checks this against the processor).

`pixel_values_videos` holds, per video, rows in the order (t, h/m, w/m, m, m) and columns (channel, frame within the
temporal patch, p, p) (Qwen2-VL's video processor; t = frames / temporal_patch_size, m = spatial merge size). Two
granularities:

- "frame" (Video-R1's behaviour): permute the T frames; frames that shared a temporal patch are split up, so the
  vision tower must encode the shuffled clip.
- "patch": permute the t temporal patches, keeping each patch's frames together. Qwen2.5-VL's vision tower attends
  only within a temporal patch (its full-attention blocks use one sequence per temporal patch, its windows lie inside
  one, its rotary embedding ignores t), so the shuffled clip's vision features are the ordered clip's, permuted in
  blocks of (h/m)·(w/m) tokens: the tower need not run again. tests/temporal/test_shuffle.py checks this claim
  against the tower's own output.

The permutation is drawn from a generator seeded by (trainer seed, step, sample id, video index): reproducible, the
same on every rank for the same prompt, and a fresh one each time the prompt comes back in a later step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Literal

import torch

from rollplex_trl.data.framed import FramedPrompt
from rollplex_trl.data.prompt import PreparedPrompt, new_prompt_key
from rollplex_trl.data.video import SampledVideo

Granularity = Literal["frame", "patch"]


@dataclass(frozen=True)
class ShuffledVideo:
    """How a shuffled copy was made from its ordered prompt: per video, the permutation of its units (frames or
    temporal patches) such that unit i of the shuffled clip is unit `permutations[v][i]` of the ordered one."""

    ordered: PreparedPrompt
    granularity: Granularity
    permutations: tuple[torch.Tensor, ...]


def shuffle_permutation(num_units: int, *, seed: int, step: int, sample_id: str, video_index: int = 0
                        ) -> torch.Tensor:
    """A permutation of `num_units`, a function of its arguments only (no global RNG: every rank draws the same)."""
    digest = hashlib.sha256(f"rollplex-temporal:{seed}:{step}:{sample_id}:{video_index}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.randperm(num_units, generator=generator)


def _video_slices(grid_thw: torch.Tensor) -> list[tuple[int, int, int, int, int]]:
    """(row start, row end, t, h, w) of each video's rows in `pixel_values_videos`."""
    out, start = [], 0
    for t, h, w in grid_thw.tolist():
        out.append((start, start + t * h * w, t, h, w))
        start += t * h * w
    return out


def shuffle_video_pixels(pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor,
                         permutations: list[torch.Tensor], granularity: Granularity, temporal_patch_size: int,
                         channels: int = 3) -> torch.Tensor:
    """`pixel_values_videos` with each video's frames ("frame") or temporal patches ("patch") permuted.

    `permutations[v]` has one entry per frame (t · temporal_patch_size) or per temporal patch (t) of video v.
    """
    slices = _video_slices(video_grid_thw)
    if len(permutations) != len(slices):
        raise ValueError(f"{len(permutations)} permutations for {len(slices)} videos")
    width, tp = pixel_values_videos.size(1), temporal_patch_size
    if width % (channels * tp):
        raise ValueError(f"pixel rows of width {width} are not {channels} channels x {tp} frames x p x p")
    pixels = width // (channels * tp)  # p·p
    parts = []
    for (start, end, t, h, w), perm in zip(slices, permutations, strict=True):
        video = pixel_values_videos[start:end].reshape(t, h * w, width)
        units = t if granularity == "patch" else t * tp
        if perm.numel() != units:
            raise ValueError(f"a {granularity} permutation of a video with {t} temporal patches needs {units} "
                             f"entries, got {perm.numel()}")
        if granularity == "patch":
            parts.append(video[perm].reshape(-1, width))
            continue
        # columns are (channel, frame within the patch, p·p): bring the frame axis out, permute, put it back
        frames = video.reshape(t, h * w, channels, tp, pixels).permute(0, 3, 1, 2, 4).reshape(t * tp, h * w, -1)
        frames = frames[perm].reshape(t, tp, h * w, channels, pixels).permute(0, 2, 3, 1, 4)
        parts.append(frames.reshape(-1, width))
    return torch.cat(parts) if parts else pixel_values_videos.clone()


def shuffle_sampled_frames(video: SampledVideo, permutation: torch.Tensor, granularity: Granularity,
                           temporal_patch_size: int) -> SampledVideo:
    """The loader's sampled frames (T, 3, H, W) in the shuffled order `shuffle_video_pixels` gives the processed
    tensor, for engines that run the processor themselves. The sampling metadata (frame indices, fps) is kept: the
    M-RoPE time of each slot is unchanged, only what the slot shows moves."""
    frames = video.frames
    if granularity == "patch":
        blocks = frames.reshape(frames.size(0) // temporal_patch_size, temporal_patch_size, *frames.shape[1:])
        frames = blocks[permutation].reshape(frames.shape)
    else:
        frames = frames[permutation]
    return dataclasses.replace(video, frames=frames.contiguous())


def temporal_patches(row: PreparedPrompt) -> list[int]:
    """The number of temporal patches of each of the prompt's videos (none for image and text prompts)."""
    return [] if row.video_grid_thw is None else [int(t) for t in row.video_grid_thw[:, 0].tolist()]


def shuffled_prompt(row: PreparedPrompt, *, seed: int, step: int, granularity: Granularity = "frame",
                    temporal_patch_size: int = 2, channels: int = 3) -> tuple[PreparedPrompt, ShuffledVideo] | None:
    """The shuffled copy of a video prompt and how it was made, or None where there is nothing to shuffle (no video,
    or no video with two or more temporal patches). Videos with a single temporal patch keep their order.

    The copy has the ordered prompt's tokens, token types, grids and `second_per_grid_ts` (the M-RoPE time of each
    slot is unchanged; what the slot shows is permuted) and a prompt identity of its own (`prompt_key`)."""
    counts = temporal_patches(row)
    if not any(t >= 2 for t in counts):
        return None
    permutations = []
    for v, t in enumerate(counts):
        units = t if granularity == "patch" else t * temporal_patch_size
        perm = (shuffle_permutation(units, seed=seed, step=step, sample_id=row.sample_id, video_index=v) if t >= 2
                else torch.arange(units))
        permutations.append(perm)
    pixels = shuffle_video_pixels(row.pixel_values_videos, row.video_grid_thw, permutations, granularity,
                                  temporal_patch_size, channels)
    media = {}
    if isinstance(row, FramedPrompt) and row.videos:  # an engine that processes frames itself (vLLM) gets them too
        media["videos"] = tuple(shuffle_sampled_frames(video, perm, granularity, temporal_patch_size)
                                for video, perm in zip(row.videos, permutations, strict=True))
    copy = dataclasses.replace(row, sample_id=f"{row.sample_id}/shuffled", pixel_values_videos=pixels,
                               prompt_key=new_prompt_key(), **media)
    return copy, ShuffledVideo(ordered=row, granularity=granularity, permutations=tuple(permutations))


"""Image and video prompts for vLLM: the frames our loader already sampled, never decoded twice.

`PreparedPrompt` keeps the processor's output (pixel patches) but not the sampled frames, and vLLM needs frames: it
runs the model's HF processor itself and cannot take pixel patches (Qwen2-VL's parser accepts raw frames or vision
*embeddings* only). `FramedPromptDataset` is a `PreparedPromptDataset` that keeps the `SampledVideo`s and images it
loaded in a `FramedPrompt` (a `PreparedPrompt` subclass), so the vLLM rollout reuses them: the video file is decoded
once, by our loader, and vLLM is told not to sample frames again (`do_sample_frames=False`, with the loader's frame
indices and fps, so `second_per_grid_ts` matches the trainer's) nor resize them (pixel bounds that make its resize a
no-op, as `prepare_prompt` does for the trainer's processor).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rollplex_trl.data.prepared import PREPARED_KEY, MediaPreparer, PreparedPromptDataset
from rollplex_trl.data.prompt import PreparedPrompt


@dataclass(eq=False)
class FramedPrompt(PreparedPrompt):
    """A prepared prompt that also keeps the media it was prepared from (for engines that process media)."""

    videos: tuple[Any, ...] = ()  # SampledVideo, in prompt order
    images: tuple[Any, ...] = ()  # PIL images, in prompt order
    pixel_bounds: tuple[int, int] | None = None  # (min_pixels, max_pixels) the frames were sampled with


class FramedMediaPreparer(MediaPreparer):
    """`MediaPreparer` that keeps the media it loaded in the row's `FramedPrompt` (same ids and tensors)."""

    def prepare_row(self, row: dict, sample_id: str) -> dict:
        self._loaded_videos: list[Any] = []
        self._loaded_images: list[Any] = []
        row = super().prepare_row(row, sample_id)
        prepared: PreparedPrompt = row[PREPARED_KEY]
        values = {f.name: getattr(prepared, f.name) for f in dataclasses.fields(PreparedPrompt)}
        sampling = self.options.sampling
        row[PREPARED_KEY] = FramedPrompt(**values, videos=tuple(self._loaded_videos),
                                         images=tuple(self._loaded_images),
                                         pixel_bounds=(sampling.min_pixels, sampling.max_pixels))
        return row

    def _load_video(self, value: Any, sample_id: str):
        video = super()._load_video(value, sample_id)
        self._loaded_videos.append(video)
        return video

    def _load_image(self, value: Any, sample_id: str):
        image = super()._load_image(value, sample_id)
        self._loaded_images.append(image)
        return image


class FramedPromptDataset(PreparedPromptDataset):
    """`PreparedPromptDataset` whose rows carry a `FramedPrompt` (same prompt ids and tensors, plus the media)."""

    preparer_cls = FramedMediaPreparer


def video_item(video: Any) -> tuple[Any, dict[str, Any]]:
    """vLLM's video item for one `SampledVideo`: (T, H, W, 3) uint8 frames and the sampling metadata."""
    frames = video.frames.permute(0, 2, 3, 1).contiguous().numpy()  # (T, 3, H, W) -> (T, H, W, 3)
    metadata = {
        "fps": float(video.video_fps),
        "duration": float(video.total_frames) / float(video.video_fps),
        "total_num_frames": int(video.total_frames),
        "frames_indices": [int(i) for i in video.frame_indices],
        "video_backend": "pyav",
        "do_sample_frames": False,  # already sampled by our loader: vLLM must not sample again
    }
    return frames, metadata

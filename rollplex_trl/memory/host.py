"""Host (CPU RAM) memory of the video data, from the video settings: the part of a run's memory that is not on a GPU.

What one clip costs, following the loader (data/video.py) and the processor step by step:

- decoding: PyAV decodes frames one at a time at the source resolution (RGB uint8, H0 x W0 x 3); the frame being
  resized also exists as a (3, H0, W0) view, so the transient peak is about one source frame;
- sampled frames: the selected frames, resized (`smart_resize` with the clip's pixel budget), uint8 (T, 3, H, W);
  kept in the prepared row only for an engine that runs the processor itself (vLLM: `FramedPrompt.videos`);
- pixels: the processor's `pixel_values_videos`, float32, T x H x W x 3 values (rows of 3 x 2 x 14 x 14 per
  temporal patch of 14 x 14 pixels).

A prepared row holds the pixels (and, with vLLM, the frames). The media cache (`rollplex_media_cache_size` rows)
keeps recent rows so the G copies of a prompt decode once; a generation batch holds its prompts' rows while it is
scored. Token ids and grids are left out (kilobytes). `tests/memory/test_host.py` checks every figure against the
tensors the real pipeline builds from an MP4.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollplex_trl.data.video import (
    VideoSamplingConfig,
    frame_pixel_budget,
    frame_pixel_floor,
    smart_nframes,
    smart_resize,
)

PIXEL_BYTES = 4  # the processor's float32 pixel values
CHANNELS = 3


@dataclass(frozen=True)
class SourceClip:
    """A typical source video: its resolution, frame rate and length."""

    height: int
    width: int
    fps: float
    seconds: float

    @property
    def total_frames(self) -> int:
        return max(1, round(self.fps * self.seconds))


@dataclass(frozen=True)
class HostMediaPlan:
    frames: int  # T sampled per clip
    height: int  # sampled frame size (multiples of 28)
    width: int
    decode_bytes: int  # transient, per decoding worker: one source frame (RGB) and its tensor view
    frames_bytes: int  # the sampled frames, uint8 (T, 3, H, W)
    pixel_bytes: int  # pixel_values_videos, float32
    row_bytes: int  # one prepared row: the pixels, plus the frames where the engine keeps them
    cache_rows: int
    batch_rows: int  # unique prompts of a generation batch held while it is scored
    workers: int  # processes or threads decoding at once

    @property
    def cache_bytes(self) -> int:
        return self.cache_rows * self.row_bytes

    @property
    def batch_bytes(self) -> int:
        return self.batch_rows * self.row_bytes

    @property
    def total_bytes(self) -> int:
        """Per training process: the cache, one generation batch besides it (its rows may all be new), and the
        decoding workers' transient frames."""
        return self.cache_bytes + self.batch_bytes + self.workers * self.decode_bytes

    def rows(self) -> list[tuple[str, int]]:
        return [("one source frame while decoding (per worker)", self.decode_bytes),
                (f"sampled frames, uint8 {self.frames}x3x{self.height}x{self.width}", self.frames_bytes),
                ("processor pixels, float32", self.pixel_bytes),
                ("one prepared row", self.row_bytes),
                (f"media cache ({self.cache_rows} rows)", self.cache_bytes),
                (f"generation batch ({self.batch_rows} prompts)", self.batch_bytes),
                (f"total per training process ({self.workers} decoding)", self.total_bytes)]


def plan_host_media(clip: SourceClip, sampling: VideoSamplingConfig, *, cache_rows: int = 64, batch_rows: int = 1,
                    workers: int = 1, keep_frames: bool = False) -> HostMediaPlan:
    """The host memory of `clip`-like videos under `sampling` (the trainer's `rollplex_video_*` settings).
    `keep_frames`: the rollout engine processes frames itself (vLLM), so a prepared row keeps them too."""
    frames = smart_nframes(clip.total_frames, clip.fps, sampling, where="plan")
    height, width = smart_resize(clip.height, clip.width, factor=sampling.image_factor,
                                 min_pixels=frame_pixel_floor(sampling, frames),
                                 max_pixels=frame_pixel_budget(sampling, frames))
    frames_bytes = frames * CHANNELS * height * width
    pixel_bytes = frames * CHANNELS * height * width * PIXEL_BYTES
    return HostMediaPlan(frames=frames, height=height, width=width,
                         decode_bytes=clip.height * clip.width * CHANNELS,
                         frames_bytes=frames_bytes, pixel_bytes=pixel_bytes,
                         row_bytes=pixel_bytes + (frames_bytes if keep_frames else 0),
                         cache_rows=cache_rows, batch_rows=batch_rows, workers=workers)


def format_host_plan(plan: HostMediaPlan, clip: SourceClip) -> str:
    lines = [f"Host memory of the video data: source {clip.width}x{clip.height} at {clip.fps:g} fps, "
             f"{clip.seconds:g} s -> {plan.frames} frames of {plan.width}x{plan.height}"]
    lines += [f"  {name:58s} {nbytes / 2**20:10.1f} MiB" for name, nbytes in plan.rows()]
    return "\n".join(lines)

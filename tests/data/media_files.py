"""Helpers for the data tests: real media files written with PyAV, independently of the code under test."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

# Grey level of frame k in the "numbered" test videos: far enough apart (step 6) that a decoded frame's mean
# identifies its index even after lossy coding, and below 255 for up to 40 frames.
GREY_BASE, GREY_STEP = 10, 6


def grey_level(index: int) -> int:
    """Grey level written into frame ``index`` of a numbered video."""
    return GREY_BASE + GREY_STEP * index


def encoder_for(container_suffix: str) -> str:
    """An encoder this PyAV build has; H.264 when available (it is in the PyPI wheels)."""
    for codec in ("libx264", "mpeg4"):
        if codec in av.codec.codecs_available:
            return codec
    pytest.skip(f"no usable video encoder for {container_suffix} in this PyAV build")


def write_video(path: Path, frames: np.ndarray, fps: int, faststart: bool = False) -> Path:
    """Encode uint8 (T, H, W, 3) RGB frames with PyAV, independently of the code under test.

    ``faststart=True`` puts an MP4's index (moov atom) before the data, as files prepared for streaming have it.
    """
    codec = encoder_for(path.suffix)
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), mode="w", options=options) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1], frames.shape[2]
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "4", "preset": "ultrafast"}
        else:
            stream.bit_rate = 8_000_000
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path


def truncate_at_packet(path: Path, out: Path, fraction: float = 0.5) -> Path:
    """Copy of ``path`` cut after the video packet that ends nearest ``fraction`` of its bytes.

    A cut between packets (not inside one) is what makes a truncated faststart MP4 decode its first frames without
    any decoder error, the case a loader must catch by counting frames.
    """
    data = path.read_bytes()
    with av.open(str(path)) as container:
        ends = [p.pos + p.size for p in container.demux(video=0) if p.size and p.pos is not None]
    cut = min(ends, key=lambda end: abs(end - fraction * len(data)))
    out.write_bytes(data[:cut])
    return out


def numbered_frames(num_frames: int, height: int = 56, width: int = 84) -> np.ndarray:
    """Frames whose uniform grey level encodes their index (see ``grey_level``)."""
    levels = np.array([grey_level(index) for index in range(num_frames)], dtype=np.uint8)
    return np.broadcast_to(levels[:, None, None, None], (num_frames, height, width, 3)).copy()

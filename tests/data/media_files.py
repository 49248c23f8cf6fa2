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


def write_video(path: Path, frames: np.ndarray, fps: int) -> Path:
    """Encode uint8 (T, H, W, 3) RGB frames with PyAV, independently of the code under test."""
    codec = encoder_for(path.suffix)
    with av.open(str(path), mode="w") as container:
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


def numbered_frames(num_frames: int, height: int = 56, width: int = 84) -> np.ndarray:
    """Frames whose uniform grey level encodes their index (see ``grey_level``)."""
    levels = np.array([grey_level(index) for index in range(num_frames)], dtype=np.uint8)
    return np.broadcast_to(levels[:, None, None, None], (num_frames, height, width, 3)).copy()

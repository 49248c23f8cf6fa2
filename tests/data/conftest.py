"""Fixtures for the data tests: real media files written with PyAV into pytest's tmp_path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from media_files import numbered_frames, write_video


@pytest.fixture
def make_numbered_video(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``make_numbered_video(num_frames, fps, suffix=".mp4")`` writes a numbered video and returns its path."""

    def make(num_frames: int, fps: int, suffix: str = ".mp4", height: int = 56, width: int = 84) -> Path:
        path = tmp_path / f"numbered_{num_frames}f_{fps}fps{suffix}"
        return write_video(path, numbered_frames(num_frames, height, width), fps)

    return make

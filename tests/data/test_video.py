"""Frame sampling: qwen-vl-utils arithmetic by hand, and real videos written and decoded with PyAV."""

from __future__ import annotations

import os

import av
import numpy as np
import pytest
import torch
from PIL import Image

from rollplex_trl.data import (
    RollplexDataError,
    VideoSamplingConfig,
    frame_pixel_budget,
    frames_to_video,
    load_video,
    sample_frame_indices,
    smart_nframes,
    smart_resize,
)

from media_files import grey_level, numbered_frames, truncate_at_packet, write_video

# ---------------------------------------------------------------------------------------------------------------------
# smart_resize
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("height", "width", "min_pixels", "max_pixels", "expected"),
    [
        # Already multiples of 28 and inside the bounds: unchanged.
        (112, 112, 16 * 28 * 28, 128 * 28 * 28, (112, 112)),
        # Rounded to the nearest multiple: 100/28 = 3.57 -> 4 -> 112; 130/28 = 4.64 -> 5 -> 140; 15,680 px fits.
        (100, 130, 4 * 28 * 28, 128 * 28 * 28, (112, 140)),
        # Too large: beta = sqrt(1080*1920 / 100352) = 4.5457; 1080/beta = 237.6 -> floor28 224; 1920/beta = 422.4
        # -> 420. 224 * 420 = 94,080 <= 100,352.
        (1080, 1920, 4 * 28 * 28, 128 * 28 * 28, (224, 420)),
        # Too small: 56x56 = 3136 < 12544; beta = sqrt(12544 / 3000) = 2.0448; 50*beta = 102.2 -> ceil28 112;
        # 60*beta = 122.7 -> 140.
        (50, 60, 16 * 28 * 28, 128 * 28 * 28, (112, 140)),
        # A side below one factor rounds to 0 and is lifted to the factor.
        (10, 10, 1, 128 * 28 * 28, (28, 28)),
    ],
)
def test_smart_resize_matches_hand_computation(height, width, min_pixels, max_pixels, expected):
    result = smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
    assert result == expected
    assert result[0] % 28 == 0 and result[1] % 28 == 0


def test_smart_resize_rejects_extreme_aspect_ratio():
    assert smart_resize(10, 2000, factor=28, min_pixels=1, max_pixels=10**9)  # ratio exactly 200 is allowed
    with pytest.raises(RollplexDataError, match="aspect ratio 201"):
        smart_resize(10, 2010)


# ---------------------------------------------------------------------------------------------------------------------
# smart_nframes, indices, pixel budget
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total_frames", "video_fps", "expected"),
    [
        (16, 8, 4),  # 2 s * 2 fps = 4
        (300, 30, 16),  # 10 s -> 20, capped at max_frames 16
        (25, 25, 4),  # 1 s -> 2, raised to min_frames 4
        (3, 30, 2),  # min_frames 4 > total 3: capped at floor2(3) = 2
        (55, 10, 10),  # 5.5 s -> 11 -> floored to 10 (qwen-vl-utils floors; rounding would give 12)
    ],
)
def test_smart_nframes_matches_qwen_vl_utils(total_frames, video_fps, expected):
    assert smart_nframes(total_frames, video_fps, VideoSamplingConfig()) == expected


def test_smart_nframes_explicit_count_and_too_short_video():
    assert smart_nframes(30, 10, VideoSamplingConfig(nframes=7)) == 8  # round_by_factor(7, 2) = round(3.5) * 2
    with pytest.raises(RollplexDataError) as caught:
        smart_nframes(1, 10, VideoSamplingConfig(), where="sample problem_id=3")
    message = str(caught.value)
    assert message.startswith("sample problem_id=3: the video has 1 frame(s), fewer than the 2 the model needs")
    # no option of the trainer helps a 1-frame video: the advice is to replace or skip it, never `nframes`
    assert "nframes" not in message and "rollplex_skip_invalid_samples=True" in message
    # an explicit nframes (an API setting) is named when it is the cause
    with pytest.raises(RollplexDataError, match=r"VideoSamplingConfig.nframes=12\) from a video of 10 frames"):
        smart_nframes(10, 10, VideoSamplingConfig(nframes=12))


@pytest.mark.parametrize(
    ("total_frames", "nframes", "expected"),
    [
        (16, 4, [0, 5, 10, 15]),
        (8, 4, [0, 2, 5, 7]),  # 0, 2.33, 4.67, 7
        (100, 6, [0, 20, 40, 59, 79, 99]),  # 0, 19.8, 39.6, 59.4, 79.2, 99
    ],
)
def test_sample_frame_indices(total_frames, nframes, expected):
    assert sample_frame_indices(total_frames, nframes) == expected


def test_frame_pixel_budget():
    # Video-R1: VIDEO_MIN_PIXELS = VIDEO_MAX_PIXELS = 100,352, no clip budget -> max(100352, int(1.05 * 100352)).
    video_r1 = VideoSamplingConfig(min_pixels=128 * 28 * 28, max_pixels=128 * 28 * 28)
    assert frame_pixel_budget(video_r1, 16) == 105_369
    # A clip budget of 200,704 px over 16 frames: 200704 / 16 * 2 = 25,088 per frame.
    budgeted = VideoSamplingConfig(total_pixels=200_704)
    assert frame_pixel_budget(budgeted, 16) == 25_088
    # ... but never below 1.05 * min_pixels = int(13171.2).
    assert frame_pixel_budget(budgeted, 64) == 13_171


def test_config_validation():
    with pytest.raises(ValueError, match="min_frames"):
        VideoSamplingConfig(min_frames=8, max_frames=4)
    with pytest.raises(ValueError, match="video_end"):
        VideoSamplingConfig(video_start=2.0, video_end=1.0)


# ---------------------------------------------------------------------------------------------------------------------
# Decoding real files
# ---------------------------------------------------------------------------------------------------------------------


def assert_frames_are(video, expected_indices):
    """Each sampled frame's grey level identifies the source frame it came from."""
    means = video.frames.float().mean(dim=(1, 2, 3))
    for mean, index in zip(means.tolist(), expected_indices, strict=True):
        assert abs(mean - grey_level(index)) < 2.5, (mean, index)


@pytest.mark.parametrize(
    ("num_frames", "fps", "expected_indices"),
    [
        (16, 8, [0, 5, 10, 15]),  # 2 s -> 4 frames
        (24, 4, [0, 2, 4, 6, 8, 10, 13, 15, 17, 19, 21, 23]),  # 6 s -> 12 frames; step 23/11 = 2.09
        (10, 25, [0, 3, 6, 9]),  # 0.4 s -> 0.8, raised to 4 frames
        (40, 5, [0, 3, 5, 8, 10, 13, 16, 18, 21, 23, 26, 29, 31, 34, 36, 39]),  # 8 s -> 16 frames; step 2.6
    ],
)
def test_load_video_samples_the_expected_frames(make_numbered_video, num_frames, fps, expected_indices):
    path = make_numbered_video(num_frames, fps)
    video = load_video(path, sample_id=7)

    assert video.total_frames == num_frames
    assert video.video_fps == pytest.approx(fps)
    assert video.frame_indices == expected_indices
    assert video.sample_fps == pytest.approx(len(expected_indices) / num_frames * fps)
    assert video.source == str(path)
    assert video.frames.dtype == torch.uint8
    # 56x84 = 4,704 px < min_pixels 12,544: scaled up by 1.633 to 91.4x137.2 -> ceil28 -> 112x140.
    assert tuple(video.frames.shape) == (len(expected_indices), 3, 112, 140)
    assert_frames_are(video, expected_indices)


def test_load_video_without_stored_frame_count(make_numbered_video):
    # Matroska stores no frame count (stream.frames == 0), so frames are counted by demuxing.
    path = make_numbered_video(24, 4, suffix=".mkv")
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0
    video = load_video(path)
    assert video.total_frames == 24
    assert video.frame_indices == [0, 2, 4, 6, 8, 10, 13, 15, 17, 19, 21, 23]
    assert_frames_are(video, video.frame_indices)


def test_load_video_explicit_nframes_and_time_window(make_numbered_video):
    path = make_numbered_video(40, 10)  # 4 s, frame k at t = k / 10

    explicit = load_video(path, VideoSamplingConfig(nframes=6))
    assert explicit.frame_indices == [0, 8, 16, 23, 31, 39]  # linspace(0, 39, 6) = 0, 7.8, 15.6, 23.4, 31.2, 39
    assert_frames_are(explicit, explicit.frame_indices)

    # Frames with 1.0 <= t <= 2.95 are 10..29 (20 frames, 2 s): 4 frames at 0, 6.33, 12.67, 19 within the window.
    window = load_video(path, VideoSamplingConfig(video_start=1.0, video_end=2.95))
    assert window.total_frames == 20
    assert window.frame_indices == [0, 6, 13, 19]
    assert_frames_are(window, [10 + index for index in window.frame_indices])


def test_load_video_keeps_colours(tmp_path):
    red = np.zeros((8, 64, 64, 3), dtype=np.uint8)
    red[..., 0] = 255
    path = write_video(tmp_path / "red.mp4", red, fps=4)
    video = load_video(path, VideoSamplingConfig(min_pixels=28 * 28))
    assert tuple(video.frames.shape) == (4, 3, 56, 56)  # 64 -> round28 -> 56
    mean_rgb = video.frames.float().mean(dim=(0, 2, 3))
    assert mean_rgb[0] > 235 and mean_rgb[1] < 20 and mean_rgb[2] < 20, mean_rgb


def test_load_video_downscales_to_budget(make_numbered_video):
    path = make_numbered_video(8, 4, height=224, width=448)
    video = load_video(path, VideoSamplingConfig(max_pixels=64 * 28 * 28))
    height, width = video.frames.shape[-2:]
    assert height % 28 == 0 and width % 28 == 0
    assert height * width <= 64 * 28 * 28
    assert (height, width) == (140, 308)  # beta = sqrt(224*448/50176) = 1.4142 -> 158.4, 316.8 -> floor28


def test_missing_video_names_sample_and_path(tmp_path):
    missing = tmp_path / "nope" / "clip.mp4"
    with pytest.raises(RollplexDataError) as caught:
        load_video(missing, sample_id=42)
    message = str(caught.value)
    assert "problem_id=42" in message and str(missing) in message
    assert "check the path / data root" in message and "rollplex_skip_invalid_samples=True" in message


def test_corrupt_video_names_sample_path_and_pyav_error(tmp_path):
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(RollplexDataError) as caught:
        load_video(corrupt, sample_id="abc")
    message = str(caught.value)
    assert "problem_id='abc'" in message and str(corrupt) in message
    assert "Invalid data found when processing input" in message  # PyAV's own text
    assert isinstance(caught.value.__cause__, av.error.FFmpegError)


def test_empty_video_file_is_an_error(tmp_path):
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(RollplexDataError, match="cannot decode"):
        load_video(empty)


def test_directory_is_not_a_video(tmp_path):
    with pytest.raises(RollplexDataError, match="file not found"):
        load_video(os.fspath(tmp_path))


# ---------------------------------------------------------------------------------------------------------------------
# Frames in memory
# ---------------------------------------------------------------------------------------------------------------------


def test_frames_to_video_pads_and_resizes_pil_list():
    images = [Image.new("RGB", (60, 50), (grey_level(i),) * 3) for i in range(3)]  # PIL sizes are (width, height)
    video = frames_to_video(images, sample_fps=2.0)
    # 3 frames -> padded to 4 by repeating the last; 50x60 -> 112x140 as in the smart_resize table above.
    assert tuple(video.frames.shape) == (4, 3, 112, 140)
    assert video.frame_indices == [0, 1, 2, 2]
    assert video.total_frames == 3 and video.sample_fps == 2.0 and video.source == "<frames>"
    assert torch.equal(video.frames[3], video.frames[2])
    assert_frames_are(video, [0, 1, 2, 2])


def test_frames_to_video_accepts_arrays_and_tensors():
    array = np.stack([np.full((56, 56, 3), grey_level(i), dtype=np.uint8) for i in range(4)])
    from_array = frames_to_video(array, sample_fps=1.0, config=VideoSamplingConfig(min_pixels=28 * 28))
    from_tensor = frames_to_video(torch.from_numpy(array).permute(0, 3, 1, 2), 1.0, VideoSamplingConfig(min_pixels=784))
    assert tuple(from_array.frames.shape) == (4, 3, 56, 56)
    assert torch.equal(from_array.frames, from_tensor.frames)
    # RGBA frames are composited on white, as qwen-vl-utils does.
    transparent = Image.new("RGBA", (56, 56), (0, 0, 0, 0))
    white = frames_to_video([transparent, transparent], 1.0, VideoSamplingConfig(min_pixels=784))
    assert int(white.frames.min()) == 255


def test_frames_to_video_errors_name_the_sample():
    with pytest.raises(RollplexDataError, match="problem_id=5.*empty"):
        frames_to_video([], 2.0, sample_id=5)
    with pytest.raises(RollplexDataError, match="uint8"):
        frames_to_video(torch.zeros(2, 3, 28, 28), 2.0, sample_id=5)
    with pytest.raises(RollplexDataError, match="frame 1 is str"):
        frames_to_video([np.zeros((28, 28, 3), np.uint8), "x"], 2.0)


def _overcounting_probe(monkeypatch, extra_frames: int) -> None:
    """Make the container seem to declare `extra_frames` more frames than the file holds."""
    import dataclasses

    import rollplex_trl.data.video as video_module

    real_probe = video_module._probe

    def overcounting_probe(*args, **kwargs):
        probe = real_probe(*args, **kwargs)
        return dataclasses.replace(probe, estimated_frames=probe.estimated_frames + extra_frames)

    monkeypatch.setattr(video_module, "_probe", overcounting_probe)


@pytest.mark.parametrize(("num_frames", "extra_frames"), [(24, 2), (40, 4), (4, 2)])
def test_load_video_recovers_from_a_slightly_wrong_container_frame_count(
    make_numbered_video, monkeypatch, num_frames, extra_frames
):
    # Containers can report a few more frames than decode (edit lists, a damaged last GOP); the decoded count wins.
    # Tolerated: up to max(2, 10% of the declared count) missing: 2 of 26, 4 of 44, 2 of 6.
    path = make_numbered_video(num_frames, 4)
    _overcounting_probe(monkeypatch, extra_frames)
    video = load_video(path)
    assert video.total_frames == num_frames
    expected = {24: [0, 2, 4, 6, 8, 10, 13, 15, 17, 19, 21, 23], 4: [0, 1, 2, 3],
                40: [0, 3, 5, 8, 10, 13, 16, 18, 21, 23, 26, 29, 31, 34, 36, 39]}[num_frames]
    assert video.frame_indices == expected
    assert_frames_are(video, video.frame_indices)


def test_load_video_refuses_a_container_count_far_above_what_decodes(make_numbered_video, monkeypatch):
    path = make_numbered_video(24, 4)
    _overcounting_probe(monkeypatch, 6)  # 24 of 30 decode: 6 missing > max(2, 3)
    with pytest.raises(RollplexDataError, match="declares 30 frames but only 24 decode; the file looks truncated"):
        load_video(path, sample_id=9)


def test_truncated_faststart_mp4_is_refused(tmp_path):
    # A faststart MP4 keeps its index at the front, so a copy cut in half still opens and declares every frame; only
    # the frames whose data survived decode.
    whole = write_video(tmp_path / "whole.mp4", numbered_frames(40), fps=5, faststart=True)
    data = whole.read_bytes()
    assert data[4:8] == b"ftyp" and data.index(b"moov") < data.index(b"mdat")  # really faststart
    cut = truncate_at_packet(whole, tmp_path / "cut.mp4", fraction=0.5)
    with av.open(str(cut)) as container:
        assert container.streams.video[0].frames == 40  # the index survived the cut
        decodable = sum(1 for _ in container.decode(video=0))  # no decoder error: the cut is between packets
    assert 10 <= decodable <= 30 and abs(cut.stat().st_size - len(data) / 2) < len(data) / 8

    assert load_video(whole).total_frames == 40
    with pytest.raises(RollplexDataError) as caught:
        load_video(cut, sample_id=77)
    message = str(caught.value)
    assert "problem_id=77" in message and str(cut) in message
    assert "declares 40 frames" in message and "truncated or corrupt" in message


@pytest.mark.parametrize("num_frames", [2, 3, 8, 13, 24, 40])
@pytest.mark.parametrize("fps", [1, 4, 30])
def test_files_from_the_repo_writers_load_whole(tmp_path, num_frames, fps):
    # The truncation check must not refuse what this repo's own writers produce (PyAV encodes, PyAV counts).
    from rollplex_trl.data.synthetic import write_mp4

    frames = numbered_frames(num_frames)
    write_mp4(tmp_path / "synthetic.mp4", frames, fps)
    write_video(tmp_path / "tests.mp4", frames, fps)
    write_video(tmp_path / "faststart.mp4", frames, fps, faststart=True)
    for name in ("synthetic.mp4", "tests.mp4", "faststart.mp4"):
        with av.open(str(tmp_path / name)) as container:
            declared = container.streams.video[0].frames
        video = load_video(tmp_path / name)
        assert declared == video.total_frames == num_frames, name

"""The host-memory plan of the video data (memory/host.py) against the tensors the trainer's own preparation builds
from real MP4 files: frame count and size, the sampled frames' and the processor's bytes, and a vLLM row's."""

import numpy as np
import pytest
from transformers import AutoProcessor

from rollplex_trl.data.framed import FramedMediaPreparer
from rollplex_trl.data.prepared import PREPARED_KEY, MediaOptions, MediaPreparer
from rollplex_trl.data.synthetic import write_mp4
from rollplex_trl.data.video import VideoSamplingConfig
from rollplex_trl.memory.host import SourceClip, format_host_plan, plan_host_media

PROMPT = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what moves?"}]}]

CASES = [  # (source height, width, fps, seconds), sampling
    ((112, 84, 4, 4.0), VideoSamplingConfig(max_frames=16, min_pixels=4 * 28 * 28, max_pixels=56 * 84)),
    ((96, 160, 8, 3.0), VideoSamplingConfig(fps=2.0, max_frames=8, min_pixels=4 * 28 * 28, max_pixels=112 * 112)),
    # a clip-level budget (total_pixels) lowers the per-frame cap of a long clip
    ((128, 128, 6, 5.0), VideoSamplingConfig(fps=3.0, max_frames=16, min_pixels=4 * 28 * 28, max_pixels=112 * 112,
                                             total_pixels=8 * 56 * 56)),
]


@pytest.fixture(scope="module")
def processor(tiny_vl_path):
    return AutoProcessor.from_pretrained(tiny_vl_path)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_plan_matches_the_prepared_row(processor, tmp_path, case):
    (height, width, fps, seconds), sampling = CASES[case]
    frames = np.random.default_rng(case).integers(0, 255, (round(fps * seconds), height, width, 3), dtype=np.uint8)
    path = tmp_path / "clip.mp4"
    write_mp4(path, frames, fps=fps)
    row = {"prompt": PROMPT, "video": str(path)}
    options = MediaOptions(sampling=sampling, cache_size=0)
    prepared = MediaPreparer(processor, options).prepare_row(dict(row), "s0")[PREPARED_KEY]
    framed = FramedMediaPreparer(processor, options).prepare_row(dict(row), "s0")[PREPARED_KEY]
    video = framed.videos[0]

    plan = plan_host_media(SourceClip(height, width, fps, seconds), sampling, cache_rows=64, batch_rows=4)
    assert (plan.frames, plan.height, plan.width) == tuple(video.frames.shape[i] for i in (0, 2, 3))
    assert plan.frames_bytes == video.frames.nbytes
    assert plan.pixel_bytes == prepared.pixel_values_videos.nbytes
    assert plan.row_bytes == prepared.pixel_values_videos.nbytes  # the transformers rollout keeps the pixels only
    vllm = plan_host_media(SourceClip(height, width, fps, seconds), sampling, keep_frames=True)
    assert vllm.row_bytes == framed.pixel_values_videos.nbytes + sum(v.frames.nbytes for v in framed.videos)
    assert plan.decode_bytes == height * width * 3
    assert plan.total_bytes == 68 * plan.row_bytes + plan.decode_bytes


def test_report_names_every_figure():
    clip = SourceClip(720, 1280, 30, 60)
    plan = plan_host_media(clip, VideoSamplingConfig(), cache_rows=64, batch_rows=8, workers=4)
    text = format_host_plan(plan, clip)
    # Video-R1's settings on a 1 min 720p clip: 16 frames (2 fps, capped), 128*28*28-pixel frames
    assert plan.frames == 16 and plan.height * plan.width <= 128 * 28 * 28
    assert "16 frames of" in text and "media cache (64 rows)" in text and "total per training process" in text


def test_plan_memory_prints_the_host_plan(capsys):
    import json

    from rollplex_trl.cli import main

    argv = ["plan-memory", "--model", "Qwen2.5-VL-7B", "--train-tp", "2", "--num-gpus", "8", "--batch", "16",
            "--video-source", "1280x720", "--video-seconds", "20", "--video-max-pixels", str(128 * 28 * 28), "--vllm"]
    assert main([*argv, "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["host"]
    clip = SourceClip(720, 1280, 30.0, 20.0)
    plan = plan_host_media(clip, VideoSamplingConfig(max_pixels=128 * 28 * 28), batch_rows=4, keep_frames=True)
    assert host["one prepared row"] == plan.row_bytes == plan.pixel_bytes + plan.frames_bytes
    assert host["generation batch (4 prompts)"] == 4 * plan.row_bytes  # 16 prompts over 4 data-parallel processes
    assert main(argv) == 0 and "Host memory of the video data" in capsys.readouterr().out
    assert main(["plan-memory", "--video-source", "720p"]) == 2
    assert "expected WIDTHxHEIGHT" in capsys.readouterr().err

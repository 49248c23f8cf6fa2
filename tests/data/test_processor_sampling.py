"""`rollplex_video_sampling="processor"`: the frames are sampled from the model's video processor's own settings
(its fps, min/max frames and pixel bounds: per frame on Qwen2.5-VL, over frames x height x width of the whole clip on
Qwen3-VL). The reference is the family's own video processor sampling and resizing the same decoded clip by itself
(`do_sample_frames`, its own `size`): the grid our loader's frames give must equal the grid it computes."""

import av
import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import AutoProcessor
from transformers.video_utils import VideoMetadata

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.data.prepared import PREPARED_KEY, MediaPreparer
from rollplex_trl.data.video import VideoSamplingConfig
from rollplex_trl.models.families import FAMILIES, processor_video_sampling
from rollplex_trl.trainers.media import media_options

from helpers import write_mp4

CLIPS = {"fits": (16, 160, 224), "over the budget": (16, 320, 448)}  # frames, height, width at 4 fps


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    from rollplex_trl.testing.checkpoints import get_checkpoint

    cache = tmp_path_factory.mktemp("checkpoints")
    return {name: (get_checkpoint(f.model_type, "tiny", cache_dir=cache),
                   AutoProcessor.from_pretrained(get_checkpoint(f.model_type, "tiny", cache_dir=cache)))
            for name, f in FAMILIES.items()}


def _decoded(path) -> torch.Tensor:
    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)


def _their_grid(processor, frames: torch.Tensor, fps: float) -> list[int]:
    """The family's video processor sampling (at `fps`) and resizing the whole decoded clip by its own settings."""
    metadata = VideoMetadata(total_num_frames=frames.shape[0], fps=4.0, frames_indices=list(range(frames.shape[0])))
    out = processor.video_processor(videos=[frames], video_metadata=[metadata], do_sample_frames=True, fps=fps,
                                    return_tensors="pt")
    return out["video_grid_thw"][0].tolist()


@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.parametrize("family", [*FAMILIES, "qwen2.5-vl capped"])
def test_frames_sampled_as_the_family_processor_samples_them(processors, tmp_path, family, clip):
    """"qwen2.5-vl capped": the tiny Qwen2.5-VL's processor has transformers' `cap_pixels_per_frame=True` (the
    qwen-vl-utils total budget); with `max_video_tokens` lowered to 64 that budget binds on both clips."""
    import copy

    processor = processors[family.removesuffix(" capped")][1]
    if family.endswith("capped"):
        assert processor.video_processor.cap_pixels_per_frame
        processor = copy.deepcopy(processor)
        processor.video_processor.max_video_tokens = 64
    n, h, w = CLIPS[clip]
    path = write_mp4(tmp_path / "clip.mp4", num_frames=n, height=h, width=w, fps=4)
    options = media_options(dict(RollplexGRPOConfig(output_dir=str(tmp_path), rollplex_video_sampling="processor",
                                                    use_cpu=True).to_dict()), None, None, processor=processor)
    sampling = options.sampling
    assert sampling.min_frames == processor.video_processor.min_frames
    assert sampling.max_frames == processor.video_processor.max_frames
    row = {"video": str(path), "prompt": [{"role": "user", "content": [{"type": "video"},
                                                                        {"type": "text", "text": "which way?"}]}]}
    prepared = MediaPreparer(processor, options).prepare_row(row, "0")[PREPARED_KEY]
    ours = prepared.video_grid_thw[0].tolist()
    assert ours == _their_grid(processor, _decoded(path), sampling.fps)
    patch = processor.video_processor.patch_size
    if (clip == "over the budget" and family == "qwen3-vl") or family.endswith("capped"):
        # the budget bound: the frames were shrunk below their source size, as the processor does
        assert ours[1] * ours[2] * patch**2 < h * w
        assert sampling.clip_max_pixels is not None or sampling.total_pixels is not None


def test_processor_sampling_differs_from_the_config_defaults_where_the_processor_says_so(processors):
    """Not a restatement of the defaults: on Qwen3-VL the clip bound is read, on Qwen2.5-VL the per-frame bounds."""
    qwen3 = processor_video_sampling(processors["qwen3-vl"][1])
    size = processors["qwen3-vl"][1].video_processor.size
    assert (qwen3["clip_min_pixels"], qwen3["clip_max_pixels"]) == (size.shortest_edge, size.longest_edge)
    assert qwen3["min_pixels"] == 32**2
    qwen25 = processor_video_sampling(processors["qwen2.5-vl"][1])
    size = processors["qwen2.5-vl"][1].video_processor.size
    assert (qwen25["min_pixels"], qwen25["max_pixels"]) == (size.shortest_edge, size.longest_edge)
    assert "clip_max_pixels" not in qwen25 and qwen25["fps"] == 2.0  # Qwen2-VL's processor has no fps: qwen-vl-utils'
    video = processors["qwen2.5-vl"][1].video_processor  # capped: qwen-vl-utils' total budget, 90% of the tokens
    assert qwen25["total_pixels"] == int(video.max_video_tokens * 28 * 28 * 0.9)
    assert VideoSamplingConfig(**qwen3) != VideoSamplingConfig()


def test_the_trainer_samples_and_records_the_processor_settings(processors, tmp_path):
    path, processor = processors["qwen3-vl"]
    clip = write_mp4(tmp_path / "clip.mp4", num_frames=16, height=320, width=448, fps=4)
    rows = [{"video": str(clip), "prompt": [{"role": "user", "content": [{"type": "video"}, {"type": "text",
                                                                                           "text": "which way?"}]}]}]
    args = RollplexGRPOConfig(output_dir=str(tmp_path / "out"), rollplex_video_sampling="processor", use_cpu=True,
                              bf16=False, max_steps=1, per_device_train_batch_size=2, num_generations=2,
                              max_completion_length=4, report_to=[], save_strategy="no")
    trainer = RollplexGRPOTrainer(model=str(path), reward_funcs=lambda completions, **k: [1.0] * len(completions),
                                  args=args, train_dataset=Dataset.from_list(rows * 2))
    sampling = trainer.media.options.sampling
    assert sampling.clip_max_pixels == processor.video_processor.size.longest_edge
    assert trainer.model.config.rollplex_video_sampling["clip_max_pixels"] == sampling.clip_max_pixels
    trainer.train()
    assert trainer.state.global_step == 1


def test_processor_sampling_refuses_fields_it_would_ignore(tmp_path):
    with pytest.raises(ValueError, match="rollplex_video_max_frames.*rollplex_video_sampling='config'"):
        RollplexGRPOConfig(output_dir=str(tmp_path), rollplex_video_sampling="processor",
                           rollplex_video_max_frames=32)


def test_a_capped_processor_is_refused_not_approximated(processors):
    """transformers' `cap_pixels_per_frame=True` floors each frame's budget at 1.05 x the clip minimum, which the
    sampling cannot express: 'processor' mode refuses it by name instead of sampling differently."""
    import copy

    processor = copy.deepcopy(processors["qwen3-vl"][1])
    processor.video_processor.cap_pixels_per_frame = True
    with pytest.raises(ValueError, match="cap_pixels_per_frame=True"):
        processor_video_sampling(processor)

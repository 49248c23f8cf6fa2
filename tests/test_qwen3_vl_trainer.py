"""Qwen3-VL video GRPO through `RollplexGRPOTrainer`, what only this family needs: frames sampled at its 32-pixel
multiple and not resized again by its processor, T-GRPO's patch reuse with its DeepStack features, the Megatron
backend's refusal. Training with every mechanism on = off and image parity with `trl.GRPOTrainer` run for every
family in tests/models/test_family_contract.py."""

import pytest
from transformers import AutoProcessor

from rollplex_trl.data.framed import FramedMediaPreparer
from rollplex_trl.data.prepared import PREPARED_KEY, MediaOptions
from rollplex_trl.data.video import VideoSamplingConfig

from family_inputs import video_grpo_run

KEYS = ("loss", "reward", "kl", "grad_norm", "entropy")


@pytest.fixture(scope="module")
def qwen3_vl_path(checkpoint_cache):
    from rollplex_trl.testing.checkpoints import get_checkpoint

    return get_checkpoint("qwen3_vl", "tiny", cache_dir=checkpoint_cache)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_frames_are_sampled_at_the_families_patch_multiple(qwen3_vl_path, tiny_vl_path, video_dataset, family):
    """Qwen3-VL patches 16-pixel squares merged 2x2 (32), Qwen2.5-VL 14 merged 2x2 (28): the loader samples frames at
    that multiple and the processor keeps them (its grid is the frames' size over the patch size)."""
    path, factor, patch = (qwen3_vl_path, 32, 16) if family == "qwen3_vl" else (tiny_vl_path, 28, 14)
    processor = AutoProcessor.from_pretrained(path)
    sampling = VideoSamplingConfig(min_pixels=4 * factor**2, max_pixels=6 * factor**2)
    for i in range(len(video_dataset)):
        prepared = FramedMediaPreparer(processor, MediaOptions(sampling=sampling, cache_size=0)).prepare_row(
            dict(video_dataset[i]), str(i))[PREPARED_KEY]
        frames = prepared.videos[0].frames
        height, width = frames.shape[-2:]
        assert height % factor == 0 and width % factor == 0
        assert 4 * factor**2 <= height * width <= 6 * factor**2
        assert prepared.video_grid_thw.tolist() == [[frames.shape[0] // 2, height // patch, width // patch]]


def test_temporal_patch_reuse_with_alpha_zero_learns_as_the_recipe_off(qwen3_vl_path, tmp_path, video_dataset):
    """T-GRPO at patch granularity (its shuffled prefill reusing the DeepStack features too) with the prefix jobs in a
    concurrent decode window: with alpha = 0 it learns exactly as the recipe off."""
    off = video_grpo_run(qwen3_vl_path, video_dataset, tmp_path / "off", False)
    temporal = video_grpo_run(qwen3_vl_path, video_dataset, tmp_path / "temporal", True, rollplex_temporal=True,
                              rollplex_temporal_alpha=0.0, rollplex_temporal_shuffle="patch", rollplex_overlap="on")
    assert len(temporal) == len(off) == 3
    for step, (a, b) in enumerate(zip(temporal, off, strict=True)):
        for key in (k for k in KEYS if k in b):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, step)
    generations = [r for r in temporal if "rollplex/temporal_vision_reused" in r]
    assert generations and all(r["rollplex/temporal_vision_reused"] == 1.0 for r in generations)
    windows = [r["rollplex/overlap_active"] for r in temporal if "rollplex/overlap_active" in r]
    assert windows and all(active == 1.0 for active in windows)


def test_megatron_backend_refuses_qwen3_vl_at_construction(qwen3_vl_path, tiny_vl_path):
    """The Megatron backend builds Qwen2.5-VL and text models; a Qwen3-VL built as a text model would lose its
    vision inputs silently, so it is refused by name before anything is built."""
    pytest.importorskip("megatron.core")
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    from rollplex_trl.backends.megatron.model import MegatronPolicy
    from rollplex_trl.models.families import megatron_refusal

    model = Qwen3VLForConditionalGeneration.from_pretrained(qwen3_vl_path)
    with pytest.raises(NotImplementedError, match="does not build 'qwen3_vl'.*rollplex_backend='hf'"):
        MegatronPolicy(model, groups=None)
    assert megatron_refusal(AutoConfig.from_pretrained(tiny_vl_path)) is None

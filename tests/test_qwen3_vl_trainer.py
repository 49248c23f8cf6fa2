"""Qwen3-VL video GRPO through `RollplexGRPOTrainer` (issue 36's second family), against the same trainer with every
Rollplex mechanism off: the frames sampled at Qwen3-VL's 32-pixel multiple and not resized again by its processor,
and with the shared prefix (prefill, scoring, actor), shared-prefix decoding and the audit on, the same samples,
rewards, KL, losses and gradient norms step for step (fp32; under TRL's defaults, bf16 autocast and checkpointing,
for the first generation batch: after an update bf16's rounding makes the samples differ, as on Qwen2.5-VL)."""

import pytest
from transformers import AutoProcessor

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.data.framed import FramedMediaPreparer
from rollplex_trl.data.prepared import PREPARED_KEY, MediaOptions
from rollplex_trl.data.video import VideoSamplingConfig

KEYS = ("loss", "reward", "kl", "grad_norm", "entropy")


@pytest.fixture(scope="module")
def qwen3_vl_path(checkpoint_cache):
    from rollplex_trl.testing.checkpoints import get_checkpoint

    return get_checkpoint("qwen3_vl", "tiny", cache_dir=checkpoint_cache)


def varied_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


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


def _run(path, dataset, tmp_path, name, on, **extra):
    mechanisms = dict(rollplex_share_prefix="on", rollplex_shared_decode="on", rollplex_verify_every=1) if on else \
        dict(rollplex_share_prefix="off", rollplex_shared_decode="off", rollplex_verify_every=0)
    args = RollplexGRPOConfig(**{**dict(
        output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, learning_rate=5e-3, beta=0.1, logging_steps=1, report_to=[], seed=11, use_cpu=True,
        bf16=False, gradient_checkpointing=False, save_strategy="no", steps_per_generation=2,
        rollplex_video_min_pixels=4 * 32 * 32, rollplex_video_max_pixels=64 * 96), **mechanisms, **extra})
    trainer = RollplexGRPOTrainer(model=str(path), reward_funcs=varied_reward, args=args, train_dataset=dataset)
    trainer.train()
    return [r for r in trainer.state.log_history if "loss" in r]


@pytest.mark.parametrize("defaults", [False, True], ids=["fp32", "trl-defaults"])
def test_qwen3_vl_video_training_with_rollplex_equals_without(qwen3_vl_path, tmp_path, video_dataset, defaults):
    extra = dict(bf16=True, gradient_checkpointing=True) if defaults else {}
    on = _run(qwen3_vl_path, video_dataset, tmp_path, "on", True, **extra)
    off = _run(qwen3_vl_path, video_dataset, tmp_path, "off", False, **extra)
    assert len(on) == len(off) == 3
    rel = 2e-2 if defaults else 1e-4
    # under bf16 the two paths round differently, so the weights after the first update differ in the last bits and
    # the next generation samples other completions: compare the first generation batch's two steps there
    compared = list(zip(on, off, strict=True))[: 2 if defaults else 3]
    for step, (a, b) in enumerate(compared):
        assert a["rollplex/prefix_rows_per_prompt"] > 1.0 and "rollplex/prefix_rows_per_prompt" not in b
        for key in (k for k in KEYS if k in b):
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-6), (key, step)
    audited = [r for r in on if "rollplex/verify_within_tolerance" in r]
    assert audited and all(r["rollplex/verify_within_tolerance"] == 1.0 for r in audited)
    assert any(abs(r["loss"]) > 0 for r in off) and any(r["grad_norm"] > 0 for r in off)
    if defaults:
        return
    # and T-GRPO at patch granularity (its shuffled prefill reusing the DeepStack features too) with the prefix jobs
    # in a concurrent decode window: with alpha = 0 it learns exactly as the recipe off
    temporal = _run(qwen3_vl_path, video_dataset, tmp_path, "temporal", True, rollplex_temporal=True,
                    rollplex_temporal_alpha=0.0, rollplex_temporal_shuffle="patch", rollplex_overlap="on")
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

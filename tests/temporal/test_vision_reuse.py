"""T-GRPO at temporal-patch granularity: the shuffled copy's prefill permutes the ordered prefill's video features
instead of running the vision tower (prefix/vision_reuse.py).

- At the prefix pass: the shuffled copies' K/V with reused features equal the K/V computed from their pixels by the
  model's own forward, and recording the ordered features leaves the ordered K/V bit-identical.
- In the trainer: a patch-granularity run with the reuse samples the same shuffled completions and learns the same
  as one with the reuse switched off, while the tower runs once less per step.
"""

import pytest
import torch
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.data.prompt import prepare_prompt
from rollplex_trl.data.video import VideoSamplingConfig, frames_to_video
from rollplex_trl.prefix.batch import run_prefix
from rollplex_trl.prefix.vision_reuse import VideoFeatureStore
from rollplex_trl.temporal import shuffled_prompt

from helpers import RecordingAccuracy

SAMPLING = VideoSamplingConfig(min_pixels=4 * 28 * 28, max_pixels=112 * 224)
G, B = 4, 8


def _clip(num_frames, h, w, seed):
    gen = torch.Generator().manual_seed(seed)
    return frames_to_video(torch.randint(0, 255, (num_frames, 3, h, w), dtype=torch.uint8, generator=gen), 2.0,
                           SAMPLING)


def _left_padded(rows, pad_id):
    width = max(len(r.prompt_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids):] = 1
    return ids, mask


def _rows(processor):
    one = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "which way?"}]}]
    two = [{"role": "user", "content": [{"type": "video"}, {"type": "video"}, {"type": "text", "text": "same?"}]}]
    return [prepare_prompt(processor, one, sample_id="a", videos=[_clip(8, 112, 224, 0)]),
            # a second prompt with two videos, one of them a single temporal patch (kept in order)
            prepare_prompt(processor, two, sample_id="b", videos=[_clip(6, 56, 112, 1), _clip(2, 56, 56, 2)])]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_reused_features_give_the_prefill_of_the_shuffled_pixels(tiny_vl_path, autocast):
    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl_path).eval()
    ordered = _rows(processor)
    copies = [shuffled_prompt(r, seed=1, step=3, granularity="patch") for r in ordered]
    assert all(c is not None for c in copies)
    shuffled = [c[0] for c in copies]
    pad = processor.tokenizer.pad_token_id
    context = (torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False))

    def prefill(rows, store=None):
        ids, mask = _left_padded(rows, pad)
        with torch.no_grad(), context:
            return run_prefix(model, ids, mask, rows, keep_graph=False, generate_positions=True, video_store=store)

    plain_ordered, plain_shuffled = prefill(ordered), prefill(shuffled)
    store = VideoFeatureStore()
    recorded = prefill(ordered, store)
    assert store.encoded == 3 and store.reused == 0 and len(store.features) == 3
    for a, b in zip(recorded.keys + recorded.values, plain_ordered.keys + plain_ordered.values, strict=True):
        assert torch.equal(a, b), "recording the features must not change the ordered prefill"
    for copy, (_, how) in zip(shuffled, copies, strict=True):
        store.derive(copy, how.ordered, how.permutations)
    calls = []
    hook = model.model.visual.register_forward_hook(lambda *args: calls.append(1))
    try:
        reused = prefill(shuffled, store)
    finally:
        hook.remove()
    assert calls == [], "the shuffled prefill ran the vision tower"
    assert store.reused == 3 and store.encoded == 3
    tolerance = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(reused.keys + reused.values, plain_shuffled.keys + plain_shuffled.values, strict=True):
        torch.testing.assert_close(a, b, **tolerance)
    # and the shuffled K/V are not the ordered ones (the test would be vacuous if the permutation did nothing)
    assert not torch.allclose(plain_shuffled.keys[0], plain_ordered.keys[0], atol=1e-3)


def test_a_video_without_recorded_features_is_encoded(tiny_vl_path):
    """A copy whose source was never prefilled with the store (a miss) goes through the tower: same result."""
    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl_path).eval()
    ordered = _rows(processor)[:1]
    copy, how = shuffled_prompt(ordered[0], seed=1, step=3, granularity="patch")
    store = VideoFeatureStore()
    store.derive(copy, how.ordered, how.permutations)
    ids, mask = _left_padded([copy], processor.tokenizer.pad_token_id)
    with torch.no_grad():
        missed = run_prefix(model, ids, mask, [copy], keep_graph=False, video_store=store)
        plain = run_prefix(model, ids, mask, [copy], keep_graph=False)
    assert store.reused == 0 and store.encoded == 1 and not store.features, "a derived copy is not recorded"
    for a, b in zip(missed.keys, plain.keys, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("defaults", [False, True], ids=["fp32", "trl-defaults"])
def test_trainer_reuse_samples_and_learns_as_without_it(tiny_vl_path, tmp_path, video_dataset, defaults):
    extra = dict(bf16=True, gradient_checkpointing=True) if defaults else {}

    def run(name, reuse):
        reward = RecordingAccuracy()
        config = RollplexGRPOConfig(**{
            **dict(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=B, num_generations=G,
                   max_completion_length=8, learning_rate=1e-2, logging_steps=1, report_to=[], seed=5, use_cpu=True,
                   bf16=False, gradient_checkpointing=False, save_strategy="no",
                   rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84, rollplex_temporal=True,
                   rollplex_temporal_shuffle="patch"), **extra})
        trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=[reward], args=config,
                                      train_dataset=video_dataset)
        if not reuse:
            trainer.temporal.before_rollout = lambda trainer: None
        sampled = []
        sample = trainer.temporal.sample

        def recording(rows, **kwargs):
            out = sample(rows, **kwargs)
            sampled.append(out.completion_ids)
            return out

        trainer.temporal.sample = recording
        tower_calls = []
        hook = trainer.model.model.visual.register_forward_hook(lambda *args: tower_calls.append(1))
        trainer.train()
        hook.remove()
        return [r for r in trainer.state.log_history if "loss" in r], reward.calls, sampled, len(tower_calls)

    logs, calls, sampled, towers = run("reuse", True)
    plain_logs, plain_calls, plain_sampled, plain_towers = run("plain", False)
    assert sampled == plain_sampled and calls == plain_calls
    assert all(r["rollplex/temporal_vision_reused"] == 1.0 for r in logs)
    assert not any("rollplex/temporal_vision_reused" in r for r in plain_logs)
    assert towers == plain_towers - 3, "one tower call less per step (the shuffled prefill's)"
    for a, b in zip(logs, plain_logs, strict=True):
        for key in ("loss", "reward", "grad_norm", "rollplex/temporal_shuffled_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key


def test_reuse_needs_a_forward_that_takes_encoder_outputs(tiny_vl_path):
    """transformers' Qwen2.5-VL forward takes `mm_encoder_outputs` here; a forward without it (an older release)
    keeps the store off and the tower runs as before."""
    from rollplex_trl.prefix.vision_reuse import accepts_encoder_outputs

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl_path)
    assert accepts_encoder_outputs(model.model)

    class Older(torch.nn.Module):
        def forward(self, input_ids=None, pixel_values_videos=None, video_grid_thw=None):
            return input_ids

    assert not accepts_encoder_outputs(Older())

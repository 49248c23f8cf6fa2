"""The rollout's prefill kept as the actor window's prefix (prefix/generation.py `PrefillForActor`).

Where the actor's prefix is due at the rollout's weights, the prefill (under the trainer's autocast, checkpointed as
training checkpoints) keeps its graph and the actor's prefix job is not run. The reference is the same
training with the reuse switched off (the prefix then built by the decode window's actor job): losses, rewards,
KL, grad norms and final weights must be equal, with one policy prompt forward fewer per generation.
"""

import pytest
import torch
from datasets import Dataset

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.prefix import batch as prefix_batch
from rollplex_trl.prefix import generation

from helpers import video_rows

KEYS = ("loss", "reward", "kl", "grad_norm", "entropy")


def varied_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


def _train(model_path, dataset, tmp_path, name, monkeypatch, *, reuse: bool, **overrides):
    """Train; returns the logged rows, the final weights, the prefills that kept their graph and all
    graph-carrying prefix forwards (the kept prefills and the actor's prefix jobs)."""
    kwargs = dict(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=2, num_generations=2,
                  gradient_accumulation_steps=2, max_completion_length=6, learning_rate=5e-3, beta=0.1,
                  logging_steps=1, report_to=[], seed=11, use_cpu=True, bf16=False, gradient_checkpointing=False,
                  save_strategy="no", rollplex_share_prefix="on", rollplex_video_min_pixels=4 * 28 * 28,
                  rollplex_video_max_pixels=56 * 84,
                  rollplex_verify_every=0)  # counted here: the prefix forwards of training, not the audit's own
    kwargs.update(overrides)
    trainer = RollplexGRPOTrainer(model=str(model_path), reward_funcs=varied_reward,
                                  args=RollplexGRPOConfig(**kwargs), train_dataset=dataset)
    if not reuse:
        monkeypatch.setattr(trainer.rollout, "actor_from_prefill", lambda: False)
    forwards = {"kept_prefills": 0, "graph_prefixes": 0}
    original_prefix, original_prefill = prefix_batch.prefix_forward, generation._prefill_unique

    def counting(*args, **kw):
        forwards["graph_prefixes"] += bool(kw.get("keep_graph"))
        return original_prefix(*args, **kw)

    def prefill(*args, keep_graph=False, **kw):
        forwards["kept_prefills"] += keep_graph
        return original_prefill(*args, keep_graph=keep_graph, **kw)

    monkeypatch.setattr(prefix_batch, "prefix_forward", counting)
    monkeypatch.setattr(generation, "_prefill_unique", prefill)
    try:
        trainer.train()
    finally:
        monkeypatch.setattr(prefix_batch, "prefix_forward", original_prefix)
        monkeypatch.setattr(generation, "_prefill_unique", original_prefill)
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return [r for r in trainer.state.log_history if "loss" in r], weights, forwards


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_prefill_serves_the_actor_exactly(tiny_vl_path, tmp_path, monkeypatch, overlap):
    dataset = Dataset.from_list(video_rows(tmp_path))
    reused, w_reused, f_reused = _train(tiny_vl_path, dataset, tmp_path, "reused", monkeypatch, reuse=True,
                                        rollplex_overlap=overlap)
    built, w_built, f_built = _train(tiny_vl_path, dataset, tmp_path, "built", monkeypatch, reuse=False,
                                     rollplex_overlap=overlap)
    # GA 2 = steps_per_generation: one generation per optimizer step, 3 of them
    assert f_reused == {"kept_prefills": 3, "graph_prefixes": 3}, f_reused
    assert f_built == {"kept_prefills": 0, "graph_prefixes": 3}, f_built
    assert len(reused) == len(built) == 3
    for step, (a, b) in enumerate(zip(reused, built, strict=True)):
        for key in (k for k in KEYS if k in b):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-8), f"{key} differs at step {step}"
    assert any(r["grad_norm"] > 0 for r in built)
    # every pass's prefix served a prompt's G = 2 completions: the reference's over the batch, the actor's over
    # the window's two micro-batches (it once divided one micro-batch's rows by the window's prompts: 1.0)
    assert all(r["rollplex/prefix_rows_per_prompt"] == 2.0 for r in reused + built)
    for name, w in w_built.items():
        assert torch.allclose(w_reused[name], w, rtol=1e-6, atol=1e-8), name


def test_prefill_serves_the_actor_under_trl_defaults(tiny_vl_path, tmp_path, monkeypatch):
    """TRL's defaults (bf16 autocast, gradient checkpointing, beta 0, dapo): the prefill runs under the trainer's
    autocast (as TRL's generate does through accelerate's wrapped forward) and, kept for the actor, checkpointed as
    the training forward is, so it is the actor job's forward: the same training as with the job building it."""
    dataset = Dataset.from_list(video_rows(tmp_path))
    defaults = dict(bf16=True, gradient_checkpointing=True, beta=0.0, loss_type="dapo")
    reused, w_reused, f_reused = _train(tiny_vl_path, dataset, tmp_path, "reused", monkeypatch, reuse=True,
                                        **defaults)
    built, w_built, f_built = _train(tiny_vl_path, dataset, tmp_path, "built", monkeypatch, reuse=False,
                                     **defaults)
    assert f_reused == {"kept_prefills": 3, "graph_prefixes": 3}, f_reused
    assert f_built == {"kept_prefills": 0, "graph_prefixes": 3}, f_built
    for step, (a, b) in enumerate(zip(reused, built, strict=True)):
        for key in (k for k in KEYS if k in b):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-8), f"{key} differs at step {step}"
    assert any(r["grad_norm"] > 0 for r in built)
    for name, w in w_built.items():
        assert torch.allclose(w_reused[name], w, rtol=1e-6, atol=1e-8), name


def test_not_reused_with_activation_offload(tiny_vl_path, tmp_path, monkeypatch):
    """Phase memory's activation offload wraps the actor's prefix job: the prefill is not kept for it then."""
    dataset = Dataset.from_list(video_rows(tmp_path))
    _, _, forwards = _train(tiny_vl_path, dataset, tmp_path, "memory", monkeypatch, reuse=True,
                            rollplex_memory="on", max_steps=1)
    assert forwards == {"kept_prefills": 0, "graph_prefixes": 1}, forwards

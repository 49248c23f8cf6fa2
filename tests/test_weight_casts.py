"""Under TRL's bf16 autocast the policy's frozen weights (here PEFT's base weights) are cast once per `generate`
call, not at every decode step (rollout/weight_casts.py, trainers/rollout.py `decode_weight_casts`).

Torch's autocast keeps the cast of a weight only if it requires grad, so frozen weights were cast again at every
decode step. Counted at the dispatcher on the decoding thread; the training must be the same to the bit with and
without (the same values are cast), the frozen weights frozen again afterwards and without gradients, and with the
overlap's actor job running concurrently (it builds a graph on the same model) the flags must be left alone.
"""

import contextlib

import pytest
import transformers

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.trainers.rollout import TrainerRollout

from helpers import WeightCasts

KEYS = ("loss", "reward", "kl", "grad_norm", "entropy")


def _reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


def _train(model_path, dataset, tmp_path, tag, monkeypatch, kept=True, **overrides):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    args = RollplexGRPOConfig(
        output_dir=str(tmp_path / tag), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=6, learning_rate=5e-2, beta=0.1, logging_steps=1, report_to=[], seed=11,
        use_cpu=True, bf16=True, gradient_checkpointing=True, save_strategy="no",
        rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84, **overrides)
    trainer = RollplexGRPOTrainer(model=str(model_path), reward_funcs=_reward, args=args, train_dataset=dataset,
                                  peft_config=lora)
    if not kept:
        monkeypatch.setattr(trainer.rollout, "decode_weight_casts", contextlib.nullcontext)
    model = trainer.accelerator.unwrap_model(trainer.model)
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    calls = []
    generate = transformers.GenerationMixin.generate

    def counting(self, *args, **kwargs):
        with WeightCasts(frozen) as casts:
            output = generate(self, *args, **kwargs)
        calls.append(casts.count)
        return output

    monkeypatch.setattr(transformers.GenerationMixin, "generate", counting)
    trainer.train()
    monkeypatch.setattr(transformers.GenerationMixin, "generate", generate)
    assert frozen and not any(p.requires_grad for p in frozen)  # restored after every rollout
    assert all(p.grad is None for p in frozen)
    logs = [{k: r[k] for k in KEYS if k in r} for r in trainer.state.log_history if "loss" in r]
    return logs, calls, len(frozen)


def test_peft_base_weights_cast_once_per_generate(tiny_vl_path, tmp_path, video_dataset_q, monkeypatch):
    kept, kept_calls, frozen = _train(tiny_vl_path, video_dataset_q, tmp_path, "kept", monkeypatch)
    plain, plain_calls, _ = _train(tiny_vl_path, video_dataset_q, tmp_path, "plain", monkeypatch, kept=False)
    assert kept == plain  # the same values cast: the same training, to the bit
    assert len(kept_calls) == len(plain_calls) == 2
    assert all(0 < casts <= frozen for casts in kept_calls), (kept_calls, frozen)
    assert all(casts > frozen for casts in plain_calls), (plain_calls, frozen)  # every step cast them again


@pytest.mark.parametrize("overlap", ["on"])
def test_left_alone_while_the_actor_job_runs_concurrently(tiny_vl_path, tmp_path, video_dataset_q, monkeypatch,
                                                          overlap):
    """The overlap's actor job builds a graph on the same model during the decode: marking the base weights as
    requiring grad then would give them gradients, so the decode casts them at every step, as TRL does."""
    monkeypatch.setattr(TrainerRollout, "actor_from_prefill", lambda self: False)  # the window's job builds it
    logs, calls, frozen = _train(tiny_vl_path, video_dataset_q, tmp_path, "overlap", monkeypatch,
                                 rollplex_overlap=overlap)
    assert len(calls) == 2 and all(casts > frozen for casts in calls), (calls, frozen)
    assert all(r["grad_norm"] > 0 for r in logs)

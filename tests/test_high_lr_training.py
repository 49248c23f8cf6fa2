"""No NaN where TRL trains on: TRL's own GRPO tests train at lr 0.1 until the policy collapses (every completion at
the length limit, entropy near 0, peaked attention). RollplexGRPOTrainer must stay finite there as trl.GRPOTrainer
does, at its defaults (shared prefix, cascade suffix attention) and under TRL's defaults (bf16 autocast, gradient
checkpointing, beta 0, dapo). The setting is that of TRL's `test_train_loss_types` (batch 3, G = 3, completions up to
32 tokens, 2 accumulation steps), where a padded-slot statistics mismatch in the cascade backward (prefix/cascade.py)
turned the gradient NaN after 8-16 steps."""

import math

import pytest
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.prefix import forward as prefix_forward_module

STEPS = 24
PROMPTS = ["The sky is", "The sun is a big", "Roses are red and", "One two three", "Hello",
           "A much longer prompt here, with words"]


def length_reward(completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [len(t) / 10 for t in texts]


def _run(trainer_cls, config_cls, model_path, tmp_path, bf16):
    args = config_cls(output_dir=str(tmp_path), learning_rate=0.1, per_device_train_batch_size=3, num_generations=3,
                      max_completion_length=32, gradient_accumulation_steps=2, max_steps=STEPS, logging_steps=1,
                      report_to=[], use_cpu=True, bf16=bf16, gradient_checkpointing=True, beta=0.0, loss_type="dapo",
                      save_strategy="no", seed=42)
    trainer = trainer_cls(model=str(model_path), reward_funcs=length_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}))
    trainer.train()
    return trainer, [r for r in trainer.state.log_history if "loss" in r]


@pytest.mark.parametrize("bf16", [True, False], ids=["trl-defaults-bf16", "fp32"])
def test_lr_0_1_stays_finite_as_trl_does(tiny_qwen2_path, tmp_path, monkeypatch, bf16):
    padded_groups = []
    group_rows = prefix_forward_module.group_rows

    def recording(rows, num_prompts):
        groups = group_rows(rows, num_prompts)
        padded_groups.append(groups.valid is not None and bool((~groups.valid).all(1).any()))
        return groups

    monkeypatch.setattr(prefix_forward_module, "group_rows", recording)
    ours, our_logs = _run(RollplexGRPOTrainer, RollplexGRPOConfig, tiny_qwen2_path, tmp_path / "ours", bf16)
    _, trl_logs = _run(GRPOTrainer, GRPOConfig, tiny_qwen2_path, tmp_path / "trl", bf16)
    assert ours.sharing.suffix_attention == "cascade"
    assert any(padded_groups), "no micro-batch served a subset of its window's prompts: the case is not exercised"
    assert len(our_logs) == len(trl_logs) == STEPS
    for logs in (our_logs, trl_logs):
        for record in logs:
            for key in ("loss", "grad_norm", "entropy", "reward"):
                assert math.isfinite(record[key]), (record["step"], key, record[key])
    # the policy collapses in both runs (the regime the NaN came from): completions hit the limit, entropy falls
    assert our_logs[-1]["entropy"] < 0.5 * our_logs[0]["entropy"]
    assert trl_logs[-1]["entropy"] < 0.5 * trl_logs[0]["entropy"]
    # the first step is at equal weights: the same training signal as TRL's
    assert our_logs[0]["loss"] == pytest.approx(trl_logs[0]["loss"], rel=2e-2, abs=1e-4)
    assert our_logs[0]["reward"] == pytest.approx(trl_logs[0]["reward"], rel=1e-6)

"""T-GRPO in the trainer (rollplex_temporal): the shuffled rollout, its rewards and its bonus.

- With α = 0 the recipe changes nothing that is learned: the shuffled completions are sampled under a forked RNG,
  so the ordered rollouts, rewards, losses and gradients equal those of the recipe off (fp32 and TRL's defaults).
- With α > 0 the bonus TRL sums is Video-R1's rule, recomputed here from the accuracy rewards the trainer's reward
  function returned for the ordered and the shuffled completions (an independent implementation of the rule).
- Text prompts have no shuffled copy and get no bonus.
"""

import math

import pytest
import torch
from datasets import Dataset

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

from helpers import RecordingAccuracy

G, B = 4, 8  # completions per prompt; rows per generation batch (two prompts)
KEYS = ("loss", "reward", "reward_std", "grad_norm", "entropy")


def _config(tmp_path, name, **overrides):
    kwargs = dict(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=B, num_generations=G,
                  max_completion_length=8, learning_rate=1e-2, logging_steps=1, report_to=[], seed=5, use_cpu=True,
                  bf16=False, gradient_checkpointing=False, save_strategy="no",
                  rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84)
    return RollplexGRPOConfig(**{**kwargs, **overrides})


def _train(model, dataset, tmp_path, name, reward=None, **overrides):
    reward = reward or RecordingAccuracy()
    trainer = RollplexGRPOTrainer(model=str(model), reward_funcs=[reward], args=_config(tmp_path, name, **overrides),
                                  train_dataset=dataset)
    trainer.train()
    return trainer, [r for r in trainer.state.log_history if "loss" in r]


@pytest.mark.parametrize("defaults", [False, True], ids=["fp32", "trl-defaults"])
def test_alpha_zero_learns_exactly_as_the_recipe_off(tiny_vl_path, tmp_path, video_dataset, defaults):
    extra = dict(bf16=True, gradient_checkpointing=True) if defaults else {}
    _, off = _train(tiny_vl_path, video_dataset, tmp_path, "off", **extra)
    trainer, on = _train(tiny_vl_path, video_dataset, tmp_path, "on", rollplex_temporal=True,
                         rollplex_temporal_alpha=0.0, **extra)
    assert trainer.reward_func_names == ["accuracy", "temporal_bonus"]
    assert len(on) == len(off) == 3
    for step, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a["rollplex/temporal_groups"] == B // G, "every video prompt should have had a shuffled copy"
        for key in KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (key, step)
        assert a["rewards/temporal_bonus/mean"] == 0.0
    assert any(r["grad_norm"] > 0 for r in off), "nothing was learned: the comparison would be vacuous"


def video_r1_bonus(ordered: list[float], shuffled: list[float], alpha: float, mu: float) -> list[float]:
    """Video-R1's T-GRPO rule for one prompt (its trainer, one prompt per device): p = mean ordered accuracy,
    p~ = mean shuffled accuracy; if p >= mu * p~, every ordered completion with accuracy > 0.1 gets alpha."""
    p, p_shuffled = sum(ordered) / len(ordered), sum(shuffled) / len(shuffled)
    return [alpha if (p >= mu * p_shuffled and a > 0.1) else 0.0 for a in ordered]


@pytest.mark.parametrize("defaults", [False, True], ids=["fp32", "trl-defaults"])
def test_bonus_is_video_r1_rule_on_the_shuffled_rollout(tiny_vl_path, tmp_path, video_dataset, defaults):
    extra = dict(bf16=True, gradient_checkpointing=True) if defaults else {}
    reward = RecordingAccuracy()
    alpha, mu, S = 0.3, 0.8, 2
    captured = []
    trainer = RollplexGRPOTrainer(
        model=str(tiny_vl_path), reward_funcs=[reward], train_dataset=video_dataset,
        args=_config(tmp_path, "bonus", max_steps=4, rollplex_temporal=True, **extra))
    sample = trainer.temporal.sample

    def recording_sample(rows, **kwargs):
        out = sample(rows, **kwargs)
        captured.append((rows, out))
        return out

    trainer.temporal.sample = recording_sample
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logs) == 4 and len(reward.calls) == 8, "one ordered and one shuffled scoring per step"
    fired = missed = 0
    for step, log in enumerate(logs):
        ordered, shuffled = reward.calls[2 * step], reward.calls[2 * step + 1]
        assert len(ordered) == B and len(shuffled) == (B // G) * S
        bonus = []
        for g in range(B // G):
            group = video_r1_bonus(ordered[g * G:(g + 1) * G], shuffled[g * S:(g + 1) * S], alpha, mu)
            bonus += group
            fired += any(group)
            missed += not any(group) and any(a > 0.1 for a in ordered[g * G:(g + 1) * G])
        expected_reward = sum(a + b for a, b in zip(ordered, bonus, strict=True)) / B
        assert log["rewards/temporal_bonus/mean"] == pytest.approx(sum(bonus) / B, abs=1e-6), step
        assert log["reward"] == pytest.approx(expected_reward, abs=1e-6), step
        p = [sum(ordered[g * G:(g + 1) * G]) / G for g in range(B // G)]
        p_shuffled = [sum(shuffled[g * S:(g + 1) * S]) / S for g in range(B // G)]
        assert log["rollplex/temporal_ordered_accuracy"] == pytest.approx(sum(p) / len(p), abs=1e-6)
        condition = [p[g] >= mu * p_shuffled[g] for g in range(B // G)]
        paid = [any(bonus[g * G:(g + 1) * G]) for g in range(B // G)]
        assert log["rollplex/temporal_condition_rate"] == pytest.approx(sum(condition) / len(condition))
        assert log["rollplex/temporal_bonus_rate"] == pytest.approx(sum(paid) / len(paid))
        assert log["rollplex/temporal_shuffled_completions"] == (B // G) * S
        assert log["rollplex/temporal_shuffled_accuracy"] == pytest.approx(sum(p_shuffled) / len(p_shuffled),
                                                                           abs=1e-6)
    assert fired and missed, (fired, missed, "the recorded steps should exercise both sides of the rule")
    # the shuffled rows are the ordered prompts with their frames permuted: same tokens, same pixels as a multiset,
    # in another order unless the drawn permutation is the identity (Video-R1's randperm can draw it too)
    reordered = 0
    for rows, pending in captured:
        assert len(pending.groups) == B // G and len(pending.completion_ids) == (B // G) * S
        for group in pending.groups:
            ordered_row = rows[group.first_row]
            assert group.row.prompt_ids == ordered_row.prompt_ids
            assert group.row.prompt_key != ordered_row.prompt_key
            a, b = group.row.pixel_values_videos, ordered_row.pixel_values_videos
            identity = all(torch.equal(p, torch.arange(p.numel())) for p in group.how.permutations)
            assert torch.equal(a, b) == identity
            assert torch.equal(a.flatten().sort().values, b.flatten().sort().values)
            reordered += not identity
    assert reordered, "no shuffled copy showed its frames in another order"


def test_text_prompts_get_no_shuffled_copy_and_no_bonus(tiny_qwen2_path, tmp_path):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i}"}] for i in range(8)]})
    _, off = _train(tiny_qwen2_path, dataset, tmp_path, "off")
    reward = RecordingAccuracy()
    _, on = _train(tiny_qwen2_path, dataset, tmp_path, "on", reward=reward, rollplex_temporal=True)
    assert len(reward.calls) == 3, "no shuffled scoring without a video"
    for step, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a["rollplex/temporal_groups"] == 0 and a["rollplex/temporal_unshuffled_groups"] == B // G
        assert a["rewards/temporal_bonus/mean"] == 0.0
        for key in KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (key, step)
    assert not any(math.isnan(r["loss"]) for r in on)


def test_resume_draws_the_same_shuffled_copies_and_samples(tiny_vl_path, tmp_path, video_dataset):
    """The permutation and the shuffled rollout's RNG are functions of (seed, step, sample, process): a run resumed
    from a checkpoint scores the same shuffled completions and logs the same bonus as the uninterrupted run."""
    kwargs = dict(max_steps=4, save_strategy="steps", save_steps=2, rollplex_temporal=True)
    full_reward = RecordingAccuracy()
    full, full_logs = _train(tiny_vl_path, video_dataset, tmp_path, "full", reward=full_reward, **kwargs)
    resumed_reward = RecordingAccuracy()
    resumed = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=[resumed_reward],
                                  args=_config(tmp_path, "resumed", **kwargs), train_dataset=video_dataset)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert len(full_reward.calls) == 8 and resumed_reward.calls == full_reward.calls[4:]
    resumed_logs = [r for r in resumed.state.log_history if "loss" in r]
    assert [r["step"] for r in resumed_logs[-2:]] == [3, 4]
    for a, b in zip(resumed_logs[-2:], full_logs[2:], strict=True):
        for key in (*KEYS, "rewards/temporal_bonus/mean", "rollplex/temporal_shuffled_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key

"""The recipe in the trainer: length control against TRL's own trainer with the bonus written as a reward function
(an independent implementation of Video-R1's rule), step for step."""

import pytest
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

G, LOW, HIGH, BONUS = 4, 3, 8, 0.2


def accuracy_reward(completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if len(t) % 3 else 0.0 for t in texts]


def video_r1_length_bonus(completions, completion_ids, **kwargs):
    """Video-R1's length control, per group of G consecutive completions (one process), as its trainer writes it."""
    accuracy = accuracy_reward(completions)
    out = []
    for start in range(0, len(completions), G):
        selected = [i for i in range(start, start + G) if accuracy[i] > 0.1]
        bonus = [0.0] * G
        if len(selected) > 1:
            for i in selected:
                if LOW <= len(completion_ids[i]) <= HIGH:
                    bonus[i - start] += BONUS
        out.extend(bonus)
    return out


def _config(cls, tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, num_generations=G,
                  max_completion_length=8, learning_rate=1e-2, logging_steps=1, report_to=[], seed=3, use_cpu=True,
                  bf16=False, save_strategy="no", gradient_checkpointing=False)
    return cls(**{**kwargs, **overrides})


@pytest.mark.parametrize("defaults", [False, True], ids=["fp32", "trl-defaults"])
def test_length_control_equals_trl_with_the_bonus_as_a_reward(tiny_qwen2_path, tmp_path, defaults):
    prompts = [[{"role": "user", "content": f"count to {i} please"}] for i in range(8)]
    dataset = Dataset.from_dict({"prompt": prompts})
    extra = dict(bf16=True, gradient_checkpointing=True) if defaults else {}
    theirs = GRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=[accuracy_reward, video_r1_length_bonus],
                         args=_config(GRPOConfig, tmp_path / "trl", **extra), train_dataset=dataset)
    theirs.train()
    ours = RollplexGRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=[accuracy_reward],
                               args=_config(RollplexGRPOConfig, tmp_path / "ours", rollplex_len_control=True,
                                            rollplex_len_control_min=LOW, rollplex_len_control_max=HIGH,
                                            rollplex_len_control_bonus=BONUS, **extra), train_dataset=dataset)
    ours.train()
    assert ours.reward_func_names == ["accuracy_reward", "length_bonus"]
    a = [r for r in ours.state.log_history if "loss" in r]
    b = [r for r in theirs.state.log_history if "loss" in r]
    assert len(a) == len(b) == 3
    fired = 0.0
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        for key in ("reward", "reward_std"):  # the same completions: the same rewards, exactly
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-6), (key, step)
        # the shared prefix sums in another order: fp32 rounding (1e-5, then 1e-4 after an lr-1e-2 step); under
        # bf16 autocast one rounding step of bf16 (2^-8 relative) on the gradient's reductions
        rel = 1e-2 if defaults else (1e-5 if step == 0 else 1e-4)
        for key in ("loss", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=rel, abs=1e-5), (key, step)
        assert x["rewards/length_bonus/mean"] == pytest.approx(y["rewards/video_r1_length_bonus/mean"], abs=1e-6)
        fired += x["rewards/length_bonus/mean"]
        # the fraction of completions paid the bonus, from the reference's mean (each pays BONUS)
        assert x["rollplex/len_control_rate"] == pytest.approx(y["rewards/video_r1_length_bonus/mean"] / BONUS,
                                                               abs=1e-6)
    assert fired > 0, "the bonus never fired: the test would not see a wrong rule"

"""On text prompts RollplexGRPOTrainer must train exactly like trl.GRPOTrainer (same seed, step for step); image
prompts, per model family: tests/models/test_family_contract.py."""

import pytest
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

from helpers import PARITY_KEYS as KEYS
from helpers import assert_same_history as _assert_same_history
from helpers import length_reward
from helpers import parity_config as _config
from helpers import parity_train as _train
from helpers import text_parity_dataset as _text_dataset


def test_text_prompts_match_trl(tiny_qwen2_path, tmp_path):
    prompts = [[{"role": "user", "content": f"count to {i} please"}] for i in range(8)]
    dataset = Dataset.from_dict({"prompt": prompts})
    theirs, _ = _train(GRPOTrainer, GRPOConfig, tiny_qwen2_path, dataset, tmp_path / "trl")
    ours, trainer = _train(RollplexGRPOTrainer, RollplexGRPOConfig, tiny_qwen2_path, dataset, tmp_path / "ours")
    _assert_same_history(ours, theirs)
    assert trainer.state.global_step == 3


def test_first_step_matches_trl_under_trl_defaults(tiny_qwen2_path, tmp_path):
    """TRL's defaults (bf16 autocast, gradient checkpointing, beta 0, dapo), one step at the same weights: the
    rollout samples the very same completions as TRL's (the shared prefill runs in the autocast TRL's generate runs
    in; computed in fp32 its K/V differ and the kept actor prefix with them), so rewards are equal, and the step's
    grad norm and entropy agree to bf16 rounding of the regrouped sums (measured: 1.1e-4 and 1.5e-4 relative in
    grad norm, text and image; 4.3e-4 and 3.7e-4 with the prefill outside autocast). Later steps are not compared:
    bf16 gradients move the two runs' weights apart, and sampled tokens may then differ."""
    path, dataset = tiny_qwen2_path, _text_dataset()
    defaults = dict(bf16=True, gradient_checkpointing=True, beta=0.0, loss_type="dapo", max_steps=1)
    theirs_ids, ours_ids = [], []
    (theirs,), _ = _train(GRPOTrainer, GRPOConfig, path, dataset, tmp_path / "trl", theirs_ids, **defaults)
    (ours,), _ = _train(RollplexGRPOTrainer, RollplexGRPOConfig, path, dataset, tmp_path / "ours", ours_ids,
                        **defaults)
    assert [t.tolist() for t in ours_ids] == [t.tolist() for t in theirs_ids]
    assert ours["reward"] == theirs["reward"]
    assert ours["grad_norm"] > 0
    for key in ("grad_norm", "entropy"):
        assert ours[key] == pytest.approx(theirs[key], rel=2e-3), key


def test_plain_grpo_config_gets_safe_defaults(tiny_qwen2_path, tmp_path):
    """A plain trl.GRPOConfig works: every rollplex_* option takes its declared default (read from the config
    class's fields, not restated here), and the run trains as with RollplexGRPOConfig()."""
    import dataclasses

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 4})
    trainer = RollplexGRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=length_reward,
                                  args=_config(GRPOConfig, tmp_path, max_steps=1), train_dataset=dataset)
    declared = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                for f in dataclasses.fields(RollplexGRPOConfig) if f.name.startswith("rollplex_")}
    assert declared and trainer.rollplex == declared
    assert trainer.rollplex["rollplex_max_prompt_length"] is None
    assert trainer.rollplex["rollplex_skip_invalid_samples"] is False
    trainer.train()
    ours = [r for r in trainer.state.log_history if "loss" in r]
    reference, _ = _train(RollplexGRPOTrainer, RollplexGRPOConfig, tiny_qwen2_path, dataset, tmp_path / "ref",
                          max_steps=1)
    assert len(ours) == len(reference) == 1
    for key in KEYS:
        assert ours[0][key] == reference[0][key], key


def test_none_rewards_match_trl(tiny_qwen2_path, tmp_path):
    """Rows a reward function cannot score (None) follow TRL's semantics exactly: the same logged rewards, loss and
    gradient as trl.GRPOTrainer with the same seed (unscorable rows get advantage 0 and leave the reward mean)."""
    def partial_reward(completions, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [None if i % 3 == 1 else float(len(t) % 7) for i, t in enumerate(texts)]

    theirs, _ = _train(GRPOTrainer, GRPOConfig, tiny_qwen2_path, _text_dataset(), tmp_path / "trl",
                       reward=partial_reward, num_generations=4)
    ours, _ = _train(RollplexGRPOTrainer, RollplexGRPOConfig, tiny_qwen2_path, _text_dataset(), tmp_path / "ours",
                     reward=partial_reward, num_generations=4)
    _assert_same_history(ours, theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a["rewards/partial_reward/mean"] == pytest.approx(b["rewards/partial_reward/mean"], rel=1e-6)

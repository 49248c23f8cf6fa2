"""On text and image prompts RollplexGRPOTrainer must train exactly like trl.GRPOTrainer (same seed, step for step)."""

import numpy as np
import pytest
from datasets import Dataset
from PIL import Image
from trl import GRPOConfig, GRPOTrainer

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

from helpers import record_generations

KEYS = ("loss", "reward", "kl", "grad_norm", "entropy", "completions/mean_length")


def length_reward(completions, **kwargs):
    """A reward that varies between completions, so advantages and gradients are non-zero."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t) % 7) for t in texts]


def _config(cls, tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, learning_rate=1e-2, beta=0.1, logging_steps=1, report_to=[], seed=7,
        use_cpu=True, bf16=False, save_strategy="no", gradient_checkpointing=False,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def _train(trainer_cls, config_cls, model_path, dataset, tmp_path, completions=None, reward=length_reward,
           **overrides):
    trainer = trainer_cls(model=str(model_path), reward_funcs=reward, args=_config(config_cls, tmp_path,
                          **overrides), train_dataset=dataset)
    if completions is not None:  # the sampled completion ids of every generation batch
        record_generations(trainer, "completion_ids", completions)
    trainer.train()
    if isinstance(trainer, RollplexGRPOTrainer):  # parity is only news if the shared paths actually ran
        assert trainer.plan.share_scoring and trainer.plan.share_actor
        assert all(r["rollplex/prefix_rows_per_prompt"] > 1 for r in trainer.state.log_history if "loss" in r)
    return [r for r in trainer.state.log_history if "loss" in r], trainer


def _assert_same_history(ours, theirs):
    """Step 1 (same weights) at 1e-5. The shared prefix sums the same terms in another order (prompts grouped once),
    so gradients agree to fp32 rounding; after an AdamW step (lr 1e-2) rounding on near-zero gradient entries moves
    weights by O(lr * rounding / eps): later steps at 1e-4 (measured: 1.1e-5 relative in grad_norm at step 2)."""
    assert len(ours) == len(theirs) == 3
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for key in KEYS:
            assert key in a and key in b, f"{key} missing at step {step}"
            rel = 1e-5 if step == 0 else 1e-4
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-5), f"{key} differs at step {step}"


def test_text_prompts_match_trl(tiny_qwen2_path, tmp_path):
    prompts = [[{"role": "user", "content": f"count to {i} please"}] for i in range(8)]
    dataset = Dataset.from_dict({"prompt": prompts})
    theirs, _ = _train(GRPOTrainer, GRPOConfig, tiny_qwen2_path, dataset, tmp_path / "trl")
    ours, trainer = _train(RollplexGRPOTrainer, RollplexGRPOConfig, tiny_qwen2_path, dataset, tmp_path / "ours")
    _assert_same_history(ours, theirs)
    assert trainer.state.global_step == 3


def test_image_prompts_match_trl(tiny_vl_path, tmp_path):
    rng = np.random.default_rng(0)
    sizes = [(56, 56), (56, 84), (84, 56), (56, 56)]
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes * 2]
    prompts = [[{"role": "user", "content": f"What is in picture {i}?"}] for i in range(8)]
    dataset = Dataset.from_dict({"prompt": prompts, "image": images})
    theirs, _ = _train(GRPOTrainer, GRPOConfig, tiny_vl_path, dataset, tmp_path / "trl")
    ours, _ = _train(RollplexGRPOTrainer, RollplexGRPOConfig, tiny_vl_path, dataset, tmp_path / "ours")
    _assert_same_history(ours, theirs)


def _text_dataset():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i} please"}] for i in range(8)]})


def _image_dataset():
    rng = np.random.default_rng(0)
    sizes = [(56, 56), (56, 84), (84, 56), (56, 56)]
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes * 2]
    prompts = [[{"role": "user", "content": f"What is in picture {i}?"}] for i in range(8)]
    return Dataset.from_dict({"prompt": prompts, "image": images})


@pytest.mark.parametrize("kind", ["text", "image"])
def test_first_step_matches_trl_under_trl_defaults(tiny_qwen2_path, tiny_vl_path, tmp_path, kind):
    """TRL's defaults (bf16 autocast, gradient checkpointing, beta 0, dapo), one step at the same weights: the
    rollout samples the very same completions as TRL's (the shared prefill runs in the autocast TRL's generate runs
    in; computed in fp32 its K/V differ and the kept actor prefix with them), so rewards are equal, and the step's
    grad norm and entropy agree to bf16 rounding of the regrouped sums (measured: 1.1e-4 and 1.5e-4 relative in
    grad norm, text and image; 4.3e-4 and 3.7e-4 with the prefill outside autocast). Later steps are not compared:
    bf16 gradients move the two runs' weights apart, and sampled tokens may then differ."""
    path, dataset = (tiny_qwen2_path, _text_dataset()) if kind == "text" else (tiny_vl_path, _image_dataset())
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

"""rollplex_share_prefix on vs off: same losses, rewards, KL and grad norms step for step (same seed).

The rollout is part of the comparison: with sharing on, the transformers rollout prefills each prompt once; the
samples must still be the same, or rewards (and everything after) would differ.
"""


import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer

KEYS = ("loss", "reward", "kl", "grad_norm", "entropy")


def varied_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


def _config(tmp_path, share, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / share), max_steps=5, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=6, learning_rate=5e-3, beta=0.1, logging_steps=1, report_to=[], seed=11,
        use_cpu=True, bf16=False, save_strategy="no", rollplex_share_prefix=share,
        rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84,
    )
    kwargs.update(overrides)
    return RollplexGRPOConfig(**kwargs)


def _run(model, dataset, tmp_path, share, peft_config=None, **overrides):
    trainer = RollplexGRPOTrainer(model=str(model), reward_funcs=varied_reward,
                                  args=_config(tmp_path, share, **overrides), train_dataset=dataset,
                                  peft_config=peft_config)
    trainer.train()
    return [r for r in trainer.state.log_history if "loss" in r]


def _assert_equivalent(on, off, steps=5):
    assert len(on) == len(off) == steps
    for step, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a["rollplex/prefix_rows_per_prompt"] > 1.0, "the shared prefix was not used"
        if "reward" in b:  # a generation step: the rollout's prefill was shared too
            assert a["rollplex/prefill_rows_per_prompt"] > 1.0, "the rollout prefilled every completion"
        assert "rollplex/prefix_rows_per_prompt" not in b, "the shared prefix ran although switched off"
        for key in (k for k in KEYS if k in b):  # reward is only logged at generation steps
            assert key in a, f"{key} missing at step {step}"
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), f"{key} differs at step {step}"
    assert any(abs(r["loss"]) > 0 for r in off) and any(r["grad_norm"] > 0 for r in off)


def test_video_gradient_accumulation_and_checkpointing(tiny_vl_path, tmp_path, video_dataset):
    # GA=2: TRL scatters each group over two micro-batches; the actor prefix must serve both and backprop once.
    kwargs = dict(gradient_accumulation_steps=2, per_device_train_batch_size=2, gradient_checkpointing=True)
    on = _run(tiny_vl_path, video_dataset, tmp_path, "auto", **kwargs)
    off = _run(tiny_vl_path, video_dataset, tmp_path, "off", **kwargs)
    _assert_equivalent(on, off)


def test_video_num_iterations_uses_old_logps(tiny_vl_path, tmp_path, video_dataset):
    # num_iterations=2 computes old log-probs and re-reads the weights after an update: the actor prefix must be
    # rebuilt for every window, never reused across an optimizer step.
    kwargs = dict(num_iterations=2, gradient_checkpointing=False, max_steps=4)
    on = _run(tiny_vl_path, video_dataset, tmp_path, "auto", **kwargs)
    off = _run(tiny_vl_path, video_dataset, tmp_path, "off", **kwargs)
    _assert_equivalent(on, off, steps=4)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo"])
def test_text_every_loss_type(tiny_qwen2_path, tmp_path, loss_type):
    prompts = [[{"role": "user", "content": f"count to {i} " * (1 + i % 3)}] for i in range(8)]
    dataset = Dataset.from_dict({"prompt": prompts})
    # EOS biased up: the tiny random model would otherwise never end a completion within 6 tokens, every completion
    # would have the same length, and the loss types' normalisers (per sequence, batch, constant) would coincide
    eos = AutoTokenizer.from_pretrained(tiny_qwen2_path).eos_token_id
    kwargs = dict(loss_type=loss_type, gradient_accumulation_steps=2, per_device_train_batch_size=4,
                  num_generations=4, max_steps=3, steps_per_generation=2,
                  generation_kwargs={"sequence_bias": [[[eos], 4.0]]})
    on = _run(tiny_qwen2_path, dataset, tmp_path, "auto", **kwargs)
    off = _run(tiny_qwen2_path, dataset, tmp_path, "off", **kwargs)
    _assert_equivalent(on, off, steps=3)
    assert off[0]["completions/min_length"] < off[0]["completions/max_length"]


def test_video_peft_reference_is_adapter_disabled(tiny_vl_path, tmp_path, video_dataset):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    kwargs = dict(gradient_checkpointing=True, max_steps=3, learning_rate=5e-2)
    on = _run(tiny_vl_path, video_dataset, tmp_path, "auto", peft_config=lora, **kwargs)
    off = _run(tiny_vl_path, video_dataset, tmp_path, "off", peft_config=lora, **kwargs)
    _assert_equivalent(on, off, steps=3)
    assert off[0]["kl"] > 0, "with a non-zero adapter the policy differs from the adapter-disabled reference"


def test_share_prefix_on_refuses_unsupported_configs(tiny_qwen2_path, tmp_path, notices, monkeypatch):
    import rollplex_trl.trainers.plan as plan

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 4})
    monkeypatch.setattr(plan, "PREFIX_MODEL_TYPES", ("llama",))  # pretend Qwen2 were an unknown decoder
    with pytest.raises(ValueError, match="rollplex_share_prefix.*model type 'qwen2'"):
        RollplexGRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=varied_reward, train_dataset=dataset,
                            args=_config(tmp_path, "on"))
    trainer = RollplexGRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=varied_reward,
                                  train_dataset=dataset, args=_config(tmp_path, "auto", max_steps=1))
    assert not trainer.plan.share_scoring and not trainer.plan.share_actor
    assert any("rollplex_share_prefix: off" in m and "qwen2" in m for m in notices), notices
    trainer.train()  # and training still works, on TRL's full forward
    assert not any("rollplex/prefix_rows_per_prompt" in r for r in trainer.state.log_history)


def test_video_cascade_suffix_vs_concat_fp32_and_trl_defaults(tiny_vl_path, tmp_path, video_dataset):
    """rollplex_suffix_attention cascade (the CPU default) vs concat in training: fp32 within 1e-4 over 5 steps
    (GA 2, beta 0.1); TRL's defaults (bf16 autocast, gradient checkpointing, beta 0, dapo) at bf16 rounding at
    step 1 (same weights; later steps carry the rounding into the weights)."""
    kwargs = dict(gradient_accumulation_steps=2, per_device_train_batch_size=2, gradient_checkpointing=True)
    runs = {a: _run(tiny_vl_path, video_dataset, tmp_path, "auto", rollplex_suffix_attention=a,
                    output_dir=str(tmp_path / f"fp32-{a}"), **kwargs) for a in ("cascade", "concat")}
    for a, b in zip(runs["cascade"], runs["concat"], strict=True):
        for key in (k for k in KEYS if k in b):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    defaults = dict(bf16=True, gradient_checkpointing=True, beta=0.0, loss_type="dapo", max_steps=1)
    bf16 = {a: _run(tiny_vl_path, video_dataset, tmp_path, "auto", rollplex_suffix_attention=a,
                    output_dir=str(tmp_path / f"bf16-{a}"), **defaults)[0] for a in ("cascade", "concat")}
    assert bf16["cascade"]["reward"] == bf16["concat"]["reward"]  # same rollout
    assert bf16["cascade"]["grad_norm"] == pytest.approx(bf16["concat"]["grad_norm"], rel=2e-2)
    assert bf16["cascade"]["entropy"] == pytest.approx(bf16["concat"]["entropy"], rel=1e-2)


def _text_dataset():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"n{i}"}] for i in range(8)]})


@pytest.mark.parametrize("defaults", [False, True], ids=["fp32", "trl-defaults"])
def test_auto_shares_only_where_the_modelled_cost_says_it_pays(tiny_qwen2_path, tiny_vl_path, tmp_path, notices,
                                                                video_dataset, defaults):
    """rollplex_share_prefix="auto" decides once, at the first rollout, from the prompts and max_completion_length
    (prefix/cost.py): short text prompts with long completions and the concat suffix (what CUDA runs) -> off, and
    the run is the "off" run exactly (TRL's full forward, no prefix work, no overlap window); a video prompt with
    short completions -> on, and the run is the "on" run exactly. Also under TRL's defaults (bf16 autocast,
    gradient checkpointing, beta 0, dapo)."""
    extra = dict(bf16=True, gradient_checkpointing=True, beta=0.0, loss_type="dapo") if defaults else {}
    low = dict(max_steps=2, max_completion_length=96, rollplex_suffix_attention="concat", **extra)
    trainer = RollplexGRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=varied_reward,
                                  train_dataset=_text_dataset(),
                                  args=_config(tmp_path, "auto", output_dir=str(tmp_path / "low-auto"),
                                               rollplex_overlap="auto", **low))
    assert trainer.plan.share_scoring and trainer.overlap is not None  # undecided until the first rollout
    trainer.train()
    choice = trainer.sharing.decision.choice
    assert choice is not None and not choice.share, choice
    assert choice.shape.completion_tokens == 96 and choice.shape.prompt_share < 0.5
    assert any(m.startswith("rollplex_share_prefix=auto: off") for m in notices), notices
    assert not trainer.sharing.on
    # the support decision (what the configuration allows) stays as made at construction: decided once
    assert trainer.plan.share_scoring and trainer.plan.share_actor
    assert trainer.overlap is None and trainer.actor_window is None
    auto = [r for r in trainer.state.log_history if "loss" in r]
    off = _run(tiny_qwen2_path, _text_dataset(), tmp_path, "off", output_dir=str(tmp_path / "low-off"), **low)
    assert len(auto) == len(off) == 2
    for a, b in zip(auto, off, strict=True):
        assert "rollplex/prefix_rows_per_prompt" not in a
        for key in (k for k in KEYS if k in b):
            assert a[key] == b[key], key  # the same computation

    high = dict(max_steps=2, **extra)
    trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=varied_reward, train_dataset=video_dataset,
                                  args=_config(tmp_path, "auto", output_dir=str(tmp_path / "high-auto"), **high))
    trainer.train()
    assert trainer.sharing.decision.choice.share and trainer.sharing.decision.choice.shape.visual_tokens > 0
    auto = [r for r in trainer.state.log_history if "loss" in r]
    on = _run(tiny_vl_path, video_dataset, tmp_path, "on", output_dir=str(tmp_path / "high-on"), **high)
    for a, b in zip(auto, on, strict=True):
        assert a["rollplex/prefix_rows_per_prompt"] > 1.0
        for key in (k for k in KEYS if k in b):
            assert a[key] == b[key], key




def test_forced_overlap_keeps_auto_sharing_on(tiny_qwen2_path, tmp_path, notices):
    """rollplex_overlap="on" needs the shared prefix. With rollplex_share_prefix="auto" on a batch where the cost
    model would turn sharing off (short text prompts, long completions, concat suffix: the case above), the forced
    setting holds: sharing is not left to the cost model (logged once), the overlap window stays and prefix work
    runs in it; the run's numbers are those of the "on" run."""
    low = dict(max_steps=2, max_completion_length=96, rollplex_suffix_attention="concat", rollplex_overlap="on")
    trainer = RollplexGRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=varied_reward,
                                  train_dataset=_text_dataset(),
                                  args=_config(tmp_path, "auto", output_dir=str(tmp_path / "forced"), **low))
    trainer.train()
    assert sum("rollplex_share_prefix=auto: on, not left to the cost model" in m for m in notices) == 1
    assert trainer.sharing.decision is None
    assert trainer.sharing.on and trainer.plan.share_actor and trainer.overlap is not None
    forced = [r for r in trainer.state.log_history if "loss" in r]
    on = _run(tiny_qwen2_path, _text_dataset(), tmp_path, "on", output_dir=str(tmp_path / "on"), **low)
    assert len(forced) == len(on) == 2
    for a, b in zip(forced, on, strict=True):
        assert a["rollplex/prefix_rows_per_prompt"] > 1.0
        for key in (k for k in KEYS if k in b):
            assert a[key] == b[key], key


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_step_time_counts_the_actor_prefix_backward(tiny_qwen2_path, tmp_path, monkeypatch, grad_accum):
    """TRL times `step_time` around its own training_step; the actor prefix's backward runs after it returns (once
    the window's last micro-step has its loss) and must count into the step. The window's closing call is made to
    take 1000 s on a clock only Rollplex's trainer reads (no real waiting), so every logged step_time must exceed
    1000 s, whatever the machine's speed (without the fix each is the real step time, well under 600 s)."""
    import time
    import types

    from rollplex_trl.prefix.actor import ActorWindow
    from rollplex_trl.trainers import grpo

    offset = {"s": 0.0}
    monkeypatch.setattr(grpo, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset["s"]))
    closing_calls = []
    original = ActorWindow.step_done

    def slow_step_done(self, model):
        closes = self.steps_left == 1 and bool(self.prefixes)  # this call runs the window's prefix backward
        original(self, model)
        if closes:
            closing_calls.append(1)
            offset["s"] += 1000.0

    monkeypatch.setattr(ActorWindow, "step_done", slow_step_done)
    trainer = RollplexGRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=varied_reward, train_dataset=_text_dataset(),
                                  args=_config(tmp_path, "on", max_steps=3, gradient_accumulation_steps=grad_accum))
    trainer.train()
    step_times = [r["step_time"] for r in trainer.state.log_history if "step_time" in r]
    assert len(closing_calls) == 3, "the actor prefix window did not close once per optimizer step"
    assert len(step_times) == 3 and all(1000.0 < t < 1600.0 for t in step_times), step_times

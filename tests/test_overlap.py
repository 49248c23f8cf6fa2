"""Prefix work in the rollout's decode window: same learning, barriers, no state leaks, clean failures."""

import functools
import json
import threading
import time

import pytest
import torch
from datasets import Dataset

import rollplex_trl.overlap.schedule as overlap_module
from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.overlap import OverlapError, OverlapExecutor, OverlapSchedule
from rollplex_trl.trainers.rollout import TrainerRollout

from helpers import RecordingReward


def _config(tmp_path, overlap, **overrides):
    kwargs = dict(output_dir=str(tmp_path / overlap), max_steps=5, per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=6, learning_rate=5e-3, beta=0.1, logging_steps=1, report_to=[], seed=5,
                  use_cpu=True, bf16=False, save_strategy="no", rollplex_overlap=overlap,
                  rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84)
    kwargs.update(overrides)
    return RollplexGRPOConfig(**kwargs)


def _train(model, dataset, tmp_path, overlap, peft_config=None, **overrides):
    reward = RecordingReward()
    trainer = RollplexGRPOTrainer(model=str(model), reward_funcs=reward, args=_config(tmp_path, overlap, **overrides),
                                  train_dataset=dataset, peft_config=peft_config)
    trainer.train()
    return trainer, [r for r in trainer.state.log_history if "loss" in r], reward.seen


@pytest.mark.parametrize("extra", [{}, {"num_iterations": 2, "max_steps": 4}])
def test_overlap_on_and_off_learn_the_same(tiny_vl_path, tmp_path, video_dataset_q, extra):
    on, logs_on, samples_on = _train(tiny_vl_path, video_dataset_q, tmp_path, "on", **extra)
    rng_on = torch.random.get_rng_state()
    off, logs_off, samples_off = _train(tiny_vl_path, video_dataset_q, tmp_path, "off", **extra)
    assert torch.equal(rng_on, torch.random.get_rng_state()), "the prefix jobs consumed random numbers"
    assert samples_on == samples_off, "overlap changed what the rollout sampled"
    assert len(logs_on) == len(logs_off) == extra.get("max_steps", 5)
    for a, b in zip(logs_on, logs_off, strict=True):
        for key in ("loss", "kl", "grad_norm", "entropy", "reward"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        if "reward" in b:
            assert a["rollplex/overlap_active"] == 1.0 and a["rollplex/prefix_s"] > 0
            assert a["rollplex/hidden_s"] <= a["rollplex/prefix_s"] + 1e-9
            assert a["rollplex/critical_path_s"] >= a["rollplex/decode_s"] - 1e-9
    assert all(r["rollplex/overlap_active"] == 0.0 for r in logs_off if "reward" in r)  # the serial schedule
    # module state after the windows: training mode and checkpointing flags as TRL left them
    assert on.model.training == off.model.training
    flags = [getattr(m, "gradient_checkpointing", None) for m in on.model.modules()]
    assert flags == [getattr(m, "gradient_checkpointing", None) for m in off.model.modules()]
    assert not any("_can_checkpoint_with_cache" in vars(m) for m in on.model.modules())


def test_peft_reference_pass_does_not_change_the_rollout(tiny_vl_path, tmp_path, video_dataset_q):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    _, logs_on, samples_on = _train(tiny_vl_path, video_dataset_q, tmp_path, "on", peft_config=lora, max_steps=3)
    _, logs_off, samples_off = _train(tiny_vl_path, video_dataset_q, tmp_path, "off", peft_config=lora, max_steps=3)
    assert samples_on == samples_off
    for a, b in zip(logs_on, logs_off, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-5, abs=1e-7)


def _text_trainer(tiny_qwen2_path, tmp_path, overlap="on", **overrides):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count {i} " * (i + 1)}] for i in range(4)]})
    return RollplexGRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=RecordingReward(), train_dataset=dataset,
                               args=_config(tmp_path, overlap, **{"max_steps": 2, **overrides}))


def test_a_weight_write_inside_the_window_is_detected(tiny_qwen2_path, tmp_path):
    trainer = _text_trainer(tiny_qwen2_path, tmp_path)
    enc = trainer.processing_class(["count to three", "count to three"], return_tensors="pt", padding=True)
    window = trainer.rollout.decode_window(None)
    prefixes = trainer.batch.prefixes  # where the window's states would go
    assert trainer.rollout.prefix_jobs().for_window(enc["input_ids"], enc["attention_mask"], None, training=True)
    with pytest.raises(OverlapError, match="written while"):
        with window(enc["input_ids"], enc["attention_mask"]):
            with torch.no_grad():  # what an optimizer step or a weight sync would do
                next(trainer.model.parameters()).add_(0.0)
    assert (prefixes.ref, prefixes.old, prefixes.actor) == (None, None, None), "no state of the violated window"


def test_optimizer_barrier_refuses_pending_readers():
    executor = OverlapExecutor("cpu", timeout_s=5)
    release = threading.Event()
    job = executor.submit("slow", lambda: release.wait(5))
    with pytest.raises(OverlapError, match="still read"):
        executor.assert_idle()
    release.set()
    assert job.result() is True
    executor.assert_idle()
    executor.close()


def _no_prefix_states(trainer) -> bool:
    """Nothing of a failed window is left for a scoring pass or the actor to use."""
    prefixes = trainer.batch.prefixes
    return (prefixes.ref, prefixes.old, prefixes.actor) == (None, None, None)


def test_a_failing_prefix_job_surfaces_with_its_traceback(tiny_qwen2_path, tmp_path, monkeypatch):
    def broken_prefix(*args, **kwargs):
        raise ValueError("boom in the prefix job")

    monkeypatch.setattr(overlap_module, "precompute_prefix", broken_prefix)
    trainer = _text_trainer(tiny_qwen2_path, tmp_path)
    # surfaced as the job's own error, not after rollplex_overlap_timeout_s (600 s: that raises "did not finish
    # within" instead); the message decides, not a wall-clock bound, which a loaded machine could break
    with pytest.raises(OverlapError, match="prefix job 'ref' failed: ValueError: boom") as info:
        trainer.train()
    assert isinstance(info.value.__cause__, ValueError)
    frames = []
    tb = info.value.__cause__.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "broken_prefix" in frames, "the original traceback was lost"
    assert _no_prefix_states(trainer) and trainer.overlap.executor._jobs == []


def test_a_hung_prefix_job_times_out(tiny_qwen2_path, tmp_path, monkeypatch):
    def slow_prefix(*args, **kwargs):
        time.sleep(3)

    monkeypatch.setattr(overlap_module, "precompute_prefix", slow_prefix)
    trainer = _text_trainer(tiny_qwen2_path, tmp_path, rollplex_overlap_timeout_s=0.5)
    with pytest.raises(OverlapError, match="did not finish within"):
        trainer.train()
    assert _no_prefix_states(trainer)


def test_interrupt_during_decoding_leaves_nothing_behind(tiny_qwen2_path, tmp_path, monkeypatch):
    trainer = _text_trainer(tiny_qwen2_path, tmp_path)
    model_cls = type(trainer.accelerator.unwrap_model(trainer.model))

    def interrupted_generate(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model_cls, "generate", interrupted_generate)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.overlap is None or trainer.overlap.executor._jobs == []
    assert _no_prefix_states(trainer)


def test_auto_decides_and_logs(tiny_qwen2_path, tmp_path, notices, monkeypatch):
    monkeypatch.setattr(OverlapSchedule, "auto_measures_on_cpu", True)  # CPU keeps serial otherwise
    trainer = _text_trainer(tiny_qwen2_path, tmp_path, overlap="auto", max_steps=4, rollplex_timeline=True)
    trainer.train()
    decided = [m for m in notices if m.startswith("rollplex_overlap=auto")]
    assert decided and ("-> overlap ON" in decided[-1] or "-> overlap OFF" in decided[-1]), notices
    active = [r["rollplex/overlap_active"] for r in trainer.state.log_history if "rollplex/overlap_active" in r]
    assert active[:3] == [0.0, 0.0, 1.0]  # a serial warm-up, measured serially, then overlapped
    trace = json.loads((tmp_path / "auto" / "rollplex_timeline.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"decode", "ref", "micro-step"} <= names
    assert (tmp_path / "auto" / "rollplex_timeline.png").stat().st_size > 0


@pytest.mark.parametrize(("overlap", "source"), [("on", "job"), ("off", "job"), ("off", "prefill")])
def test_the_actor_prefix_job_checkpoints_like_the_training_forward(tiny_vl_path, tmp_path, video_dataset_q,
                                                                   monkeypatch, overlap, source):
    """The decode window opens inside TRL's generation context, which turns gradient checkpointing off; the actor's
    prefix (kept with its graph until the backward), built by the window's job or kept from the rollout's prefill,
    must still checkpoint every decoder layer and vision block that TRL's training forward checkpoints, or it keeps
    all of the prompt's activations. Counted at transformers' own `checkpoint` (the function its checkpointing
    layers call), with the overlap concurrent and serial."""
    import transformers.modeling_utils as modeling_utils

    if source == "job":  # else the rollout's prefill is kept as the actor's prefix (prefix/generation.py)
        monkeypatch.setattr(TrainerRollout, "actor_from_prefill", lambda self: False)

    real_checkpoint = modeling_utils.checkpoint
    calls = []  # (the checkpointed layer, its hidden states' shape) of every grad-enabled checkpointed forward

    def layer_of(function):  # transformers passes partial(forward, layer, ...); the cascade suffix wraps that
        while not isinstance(function, functools.partial):
            function = next(cell.cell_contents for cell in function.__closure__ if callable(cell.cell_contents))
        return function.args[0]

    def counting_checkpoint(function, *args, **kwargs):
        calls.append((layer_of(function), tuple(args[0].shape)))
        return real_checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "checkpoint", counting_checkpoint)  # read when checkpointing is enabled
    trainer, logs, _ = _train(tiny_vl_path, video_dataset_q, tmp_path, overlap, max_steps=1, beta=0.0)
    assert trainer.args.gradient_checkpointing and len(logs) == 1
    model = trainer.accelerator.unwrap_model(trainer.model)
    decoder_layers, vision_blocks = list(model.model.language_model.layers), list(model.model.visual.blocks)
    completion = trainer.args.max_completion_length
    # decoder layers over the prompts (longer than any completion: the suffix pass runs C + 1 tokens at most)
    prefix_layers = {id(layer) for layer, shape in calls if len(shape) == 3 and shape[1] > completion + 1}
    checkpointed_blocks = {id(layer) for layer, _ in calls if any(layer is block for block in vision_blocks)}
    assert prefix_layers == {id(layer) for layer in decoder_layers}, "decoder layers ran uncheckpointed"
    assert checkpointed_blocks == {id(block) for block in vision_blocks}, "the vision tower ran uncheckpointed"
    # the actor prefix was the window's job, or no job ran (beta=0: no reference job)
    assert (logs[0]["rollplex/prefix_s"] > 0) == (source == "job")

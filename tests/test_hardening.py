"""Trustworthy under TRL's defaults: the overlap computes exactly what the serial schedule computes (bf16 autocast and
gradient checkpointing included), seeded runs reproduce their logs, `auto` decides once, valid TRL configurations do
not crash, bad values and rewards are refused by name, and a stuck prefix job cannot keep the process alive."""

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from datasets import Dataset

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.data.errors import RollplexDataError
from rollplex_trl.overlap import OverlapSchedule
from rollplex_trl.trainers.rewards import reject_non_finite_rewards

from helpers import RecordingReward

# Keys whose values are wall-clock measurements: they differ between any two runs.
_TIMING = ("_s", "runtime", "per_second", "step_time", "decode_slowdown")


def _args(tmp_path, name, **overrides):
    kwargs = dict(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=6, learning_rate=5e-3, beta=0.04, gradient_accumulation_steps=2,
                  logging_steps=1, report_to=[], seed=5, use_cpu=True, save_strategy="no",
                  rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84)
    kwargs.update(overrides)
    return RollplexGRPOConfig(**kwargs)


def _train(model, dataset, args):
    reward = RecordingReward()
    trainer = RollplexGRPOTrainer(model=str(model), reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.train()
    return trainer, [r for r in trainer.state.log_history if "loss" in r], reward.seen


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-autocast", "fp32"])
def test_overlap_on_and_off_learn_the_same_under_trl_defaults(tiny_vl_path, tmp_path, video_dataset_q, bf16):
    # TRL's defaults: bf16 autocast (on CPU too), gradient checkpointing; beta > 0 and two micro-batches per step so
    # the reference and the actor prefix both run in the decode window. Before the fix: 4.5e-4 relative in
    # grad_norm (the window and the scoring-time path grouped the prompts differently).
    common = dict(bf16=bf16, gradient_checkpointing=True)
    _, on, samples_on = _train(tiny_vl_path, video_dataset_q, _args(tmp_path, "on", rollplex_overlap="on", **common))
    _, off, samples_off = _train(tiny_vl_path, video_dataset_q, _args(tmp_path, "off", rollplex_overlap="off",
                                                                    **common))
    assert samples_on == samples_off
    assert len(on) == len(off) == 3
    for step, (a, b) in enumerate(zip(on, off, strict=True)):
        for key in ("loss", "kl", "grad_norm", "reward", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-8), (step, key)
        assert a["rollplex/overlap_active"] == 1.0 and b["rollplex/overlap_active"] == 0.0


def test_shared_prefix_under_trl_defaults_matches_the_unshared_passes_to_bf16_rounding(tiny_vl_path, tmp_path,
                                                                                       video_dataset_q):
    # The shared prefix regroups the same sums; under bf16 autocast that changes rounding only. Measured at the first
    # step (same weights): grad norm 3e-4 relative, entropy equal. A broken prefix/suffix split gives O(1) errors.
    common = dict(bf16=True, gradient_checkpointing=True, max_steps=1)
    _, shared, samples_shared = _train(tiny_vl_path, video_dataset_q, _args(tmp_path, "shared", **common))
    _, plain, samples_plain = _train(tiny_vl_path, video_dataset_q,
                                     _args(tmp_path, "plain", rollplex_share_prefix="off", **common))
    assert "rollplex/prefix_rows_per_prompt" in shared[0] and "rollplex/prefix_rows_per_prompt" not in plain[0]
    assert samples_shared == samples_plain
    assert shared[0]["grad_norm"] == pytest.approx(plain[0]["grad_norm"], rel=2e-3)
    assert shared[0]["entropy"] == pytest.approx(plain[0]["entropy"], rel=1e-3)


def test_two_seeded_runs_with_default_settings_log_the_same(tiny_vl_path, tmp_path, video_dataset_q):
    # defaults: share_prefix auto, overlap auto, bf16 autocast. "auto" must not make a run depend on timing.
    runs = [_train(tiny_vl_path, video_dataset_q, _args(tmp_path, f"run{i}", max_steps=3, bf16=True))[1]
            for i in range(2)]
    for a, b in zip(*runs, strict=True):
        assert a["rollplex/overlap_active"] == 0.0  # on CPU auto keeps the serial schedule, logged every step
        untimed = [k for k in b if not any(t in k for t in _TIMING)]
        assert {k: a[k] for k in untimed} == {k: b[k] for k in untimed}


def test_evaluation_windows_do_not_count_for_auto(tiny_vl_path, tmp_path, video_dataset_q, monkeypatch):
    # eval_on_start with auto crashed ('<' between float and None) and evaluation used up the measuring windows.
    monkeypatch.setattr(OverlapSchedule, "auto_measures_on_cpu", True)
    args = _args(tmp_path, "eval", max_steps=4, gradient_accumulation_steps=1, eval_strategy="steps", eval_steps=1,
                 eval_on_start=True, per_device_eval_batch_size=4, rollplex_overlap="auto")
    trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=RecordingReward(), args=args,
                                  train_dataset=video_dataset_q, eval_dataset=video_dataset_q)
    trainer.train()
    assert trainer.overlap.decided, "three training windows were seen: auto must have decided"
    active = [r["rollplex/overlap_active"] for r in trainer.state.log_history if "loss" in r]
    assert active[:3] == [0.0, 0.0, 1.0], "warm-up serial, measured serial, measured overlapped"
    assert any("eval_loss" in r or "eval_reward" in r for r in trainer.state.log_history)


def test_eval_on_start_with_default_settings(tiny_vl_path, tmp_path, video_dataset_q):
    """Evaluation before the first step and after each one runs with default settings, and evaluates what the
    unshared path evaluates: the same rewards, loss-free metrics and completions as rollplex_share_prefix="off"."""
    runs = {}
    for share in ("auto", "off"):
        args = _args(tmp_path, f"eval-{share}", max_steps=2, gradient_accumulation_steps=1, eval_strategy="steps",
                     eval_steps=1, eval_on_start=True, per_device_eval_batch_size=4, rollplex_share_prefix=share)
        reward = RecordingReward()
        trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=reward, args=args,
                                      train_dataset=video_dataset_q, eval_dataset=video_dataset_q)
        trainer.train()
        runs[share] = ([r for r in trainer.state.log_history if "eval_reward" in r], reward.seen)
    (evals, seen), (off_evals, off_seen) = runs["auto"], runs["off"]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert seen == off_seen  # the same completions sampled and scored, training and evaluation
    for a, b in zip(evals, off_evals, strict=True):
        assert math.isfinite(a["eval_reward"])
        assert a["eval_reward"] == b["eval_reward"]
        assert a["eval_completions/mean_length"] == b["eval_completions/mean_length"]


def _text_dataset():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count {i} " * (i + 1)}] for i in range(4)]})


def test_beam_search_falls_back_to_trls_generate(tiny_qwen2_path, tmp_path, notices):
    # crashed in the shared prefill ("Sizes of tensors must match ... Expected size 3 but got size 6")
    args = _args(tmp_path, "beams", max_steps=1, gradient_accumulation_steps=1, generation_kwargs={"num_beams": 2},
                 num_generations=2, per_device_train_batch_size=2)
    trainer = RollplexGRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=RecordingReward(), args=args,
                                  train_dataset=_text_dataset())
    trainer.train()
    assert any(m.startswith("shared prefill off for generation (num_beams=2") for m in notices), notices
    assert math.isfinite(trainer.state.log_history[0]["loss"])


def test_several_returned_sequences_are_refused_clearly(tiny_qwen2_path, tmp_path):
    # TRL's own path fails deep inside with a tensor-size error; say what to do instead
    args = _args(tmp_path, "nrs", max_steps=1, generation_kwargs={"num_return_sequences": 2})
    with pytest.raises(ValueError, match="num_return_sequences=2.*set num_generations"):
        RollplexGRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=RecordingReward(), args=args,
                            train_dataset=_text_dataset())


def test_bare_on_off_in_a_yaml_config_file(tmp_path):
    from trl import TrlParser

    config = tmp_path / "recipe.yaml"
    config.write_text(textwrap.dedent(f"""\
        output_dir: {tmp_path / 'out'}
        use_cpu: true
        rollplex_overlap: off
        rollplex_share_prefix: on
        rollplex_timeline: "false"
        rollplex_video_max_frames: "8"
        """))
    (args,) = TrlParser((RollplexGRPOConfig,)).parse_args_and_config(["--config", str(config)])
    assert (args.rollplex_overlap, args.rollplex_share_prefix) == ("off", "on")
    assert args.rollplex_timeline is False and args.rollplex_video_max_frames == 8


@pytest.mark.parametrize("field,value", [
    ("rollplex_video_max_frames", 1),  # Qwen2.5-VL needs 2 frames per temporal patch: every video would fail
    ("rollplex_video_fps", float("nan")),
    ("rollplex_overlap_timeout_s", float("nan")),
    ("rollplex_overlap_timeout_s", float("inf")),
    ("rollplex_video_max_pixels", 10),  # below one 28x28 patch: crashed mid-step inside torch's resize
    ("rollplex_timeline", "flase"),
    ("rollplex_skip_invalid_samples", "maybe"),
    ("rollplex_video_max_frames", "sixteen"),
    ("rollplex_video_max_frames", True),
    ("rollplex_video_max_frames", 8.5),
    ("rollplex_max_skipped_fraction", 1.5),
    ("rollplex_overlap", "sometimes"),
])
def test_bad_values_are_refused_at_construction_naming_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        RollplexGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{field: value})


@pytest.mark.parametrize("field,value,expected", [
    ("rollplex_skip_invalid_samples", "false", False),  # was silently truthy
    ("rollplex_skip_invalid_samples", "True", True),
    ("rollplex_video_max_frames", "8", 8),
    ("rollplex_video_fps", "2.5", 2.5),
    ("rollplex_max_prompt_length", "null", None),
    ("rollplex_overlap", False, "off"),
    ("rollplex_share_prefix", True, "on"),
    ("rollplex_overlap", "OFF", "off"),
])
def test_values_from_text_and_yaml_are_read_as_their_type(tmp_path, field, value, expected):
    args = RollplexGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{field: value})
    assert getattr(args, field) == expected and type(getattr(args, field)) is type(expected)


def test_every_rollplex_field_has_a_validation_rule():
    from rollplex_trl.config import _RULES, rollplex_field_names

    assert set(_RULES) == set(rollplex_field_names())


@pytest.mark.parametrize("bad", [np.float32("nan"), torch.tensor(float("nan")), float("inf"), np.float64("-inf"),
                                 torch.tensor([float("inf")])], ids=["np-nan", "tensor-nan", "inf", "np-inf", "t1-inf"])
def test_non_finite_rewards_of_any_numeric_type_are_refused(bad):
    def reward(completions, **kwargs):
        return [1.0, bad, None]

    checked = reject_non_finite_rewards(reward, "my_reward")
    with pytest.raises(RollplexDataError, match=r"'my_reward' returned .* for problem_id=b of the batch"):
        checked(completions=[None] * 3, problem_id=["a", "b", "c"])
    fine = reject_non_finite_rewards(lambda completions, **k: [np.float32(1.0), torch.tensor(0.5), None, 2], "ok")
    assert [None if r is None else float(r) for r in fine(completions=[])] == [1.0, 0.5, None, 2.0]


def test_a_hung_prefix_job_does_not_keep_the_process_alive():
    # The timeout fires on time; the stuck worker must then not block interpreter exit (it did: a ThreadPoolExecutor
    # thread is joined at exit). The child blocks its job forever; the parent only bounds how long it waits.
    child = textwrap.dedent("""
        import threading
        from rollplex_trl.overlap import OverlapError, OverlapExecutor
        executor = OverlapExecutor("cpu", timeout_s=0.5)
        executor.submit("actor", threading.Event().wait)
        try:
            executor.wait_all()
        except OverlapError as err:
            print("raised:", err, flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "raised: prefix job 'actor' did not finish within" in done.stdout


def test_worker_jobs_run_under_the_callers_autocast_and_grad_mode():
    from rollplex_trl.overlap import OverlapExecutor

    executor = OverlapExecutor("cpu", timeout_s=30)
    weight = torch.randn(8, 8, requires_grad=True)

    def job():
        return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_grad_enabled(),
                (torch.ones(2, 8) @ weight).dtype)

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        inside = executor.submit("job", job).result()
    outside = executor.submit("job", job).result()
    executor.close()
    assert inside == (True, torch.bfloat16, False, torch.bfloat16)
    assert outside[0] is False and outside[2] is True and outside[3] == torch.float32

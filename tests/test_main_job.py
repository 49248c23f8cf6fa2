"""The README's main job (`rollplex-trl demo`) trains end to end and leaves a loadable checkpoint and logs."""

import argparse
import json

import pytest
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration, TrainerControl, TrainerState

from rollplex_trl.callbacks import JsonlLoggerCallback
from rollplex_trl.cli import build_parser, main
from rollplex_trl.demo import add_demo_arguments, answer_mention_reward


def test_demo_runs_on_qwen3_vl(tmp_path, monkeypatch, capsys):
    """`--family qwen3-vl`: the main job on a Qwen3-VL of the same sizes, frames at 2 x 2 merged 32-pixel tokens;
    every stage runs and the checkpoint loads as Qwen3-VL. (What it learns: docs/main-job.md, 3 seeds.)"""
    from transformers import Qwen3VLForConditionalGeneration

    monkeypatch.setenv("ROLLPLEX_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "demo"
    argv = ["demo", "--family", "qwen3-vl", "--output-dir", str(out), "--preset", "tiny", "--sft-steps", "1",
            "--steps", "1", "--num-samples", "4", "--heldout-samples", "2", "--eval-samples", "2",
            "--prompts-per-step", "2", "--num-generations", "4", "--threads", "2"]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["heldout"]) == ["random", "SFT", "GRPO"]
    model = Qwen3VLForConditionalGeneration.from_pretrained(out / "checkpoints" / "checkpoint-1")
    assert model.config.model_type == "qwen3_vl"
    sampling = model.config.rollplex_video_sampling
    assert sampling["max_pixels"] == 64 * 64 and sampling["image_factor"] == 32
    assert "qwen3-vl 'tiny' checkpoint" in capsys.readouterr().out


def test_demo_runs_every_stage(tmp_path, monkeypatch, capsys):
    """A short main job: SFT, GRPO, the held-out table, results.json, both pictures and a loadable checkpoint."""
    monkeypatch.setenv("ROLLPLEX_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "demo"
    argv = ["demo", "--output-dir", str(out), "--preset", "tiny", "--sft-steps", "2", "--steps", "2",
            "--num-samples", "4", "--heldout-samples", "2", "--eval-every", "1", "--eval-samples", "2",
            "--prompts-per-step", "2", "--num-generations", "4", "--threads", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("[rollplex-trl] done. checkpoint: ")
    checkpoint = out / "checkpoints" / "checkpoint-2"
    for path in (checkpoint, out / "logs.jsonl", out / "results.json"):
        assert str(path) in printed[-1]

    records = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # the console: one compact line per step (the dictionaries are in logs.jsonl), the first with the audit
    # (SFT's own lines come first, with a loss and no reward)
    step_lines = [line for line in printed if line.startswith("[rollplex-trl] step ") and "reward" in line]
    assert [line.split(" · ")[0] for line in step_lines] == ["[rollplex-trl] step 1/2", "[rollplex-trl] step 2/2"]
    assert f"reward {steps[0]['reward']:.3f}" in step_lines[0] and "audit ok" in step_lines[0]
    assert sum(line.startswith("[rollplex-trl] trained 2 steps in ") for line in printed) == 2  # SFT, GRPO
    assert not any(line.lstrip().startswith("{'loss'") for line in printed)
    for r in steps:
        assert "reward" in r and "rewards/accuracy_reward/mean" in r and "rewards/format_reward/mean" in r
        assert "rollplex/skipped_samples" in r
        assert r["rollplex/temporal_shuffled_completions"] == 2 * 2  # T-GRPO on: G/2 shuffled per prompt

    # the table: one row per model, the numbers those of results.json
    results = json.loads((out / "results.json").read_text())
    assert list(results["heldout"]) == ["random", "SFT", "GRPO"]
    header = next(i for i, line in enumerate(printed) if line.startswith("[rollplex-trl] held-out accuracy ("))
    for offset, (name, row) in enumerate(results["heldout"].items(), start=2):
        assert printed[header + offset].split() == [name, f"{row['sampled']:.3f}", f"{row['greedy']:.3f}",
                                                   f"{row['format']:.3f}"]
    # the curve: the SFT model at step 0, then every GRPO step (eval-every 1); the rollouts' accuracy per step
    assert [step for step, _ in results["heldout_curve"]] == [0, 1, 2]
    assert results["heldout_curve"][0][1] == results["heldout"]["SFT"]["sampled"]
    assert results["heldout_curve"][-1][1] == results["heldout"]["GRPO"]["sampled"]
    assert [step for step, _ in results["accuracy_reward_curve"]] == [1, 2]
    assert results["accuracy_reward_curve"][0][1] == steps[0]["rewards/accuracy_reward/mean"]
    for picture in (out / "learning_curve.png", out / "checkpoints" / "rollplex_timeline.png"):
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint)
    assert sum(p.numel() for p in model.model.visual.parameters()) > 0
    AutoProcessor.from_pretrained(checkpoint)
    # the SFT model records the frame sampling it was trained with, as the GRPO checkpoints do (`rollplex-trl ask`)
    from rollplex_trl.inference import sampling_from_checkpoint

    assert sampling_from_checkpoint(out / "sft" / "model") == sampling_from_checkpoint(checkpoint) is not None


def test_cli_demo_and_demo_module_share_options():
    """`rollplex-trl demo`, scripts/demo.sh and examples/demo.py take the same options, with the same defaults."""
    for argv in ([], ["--steps", "2", "--preset", "small", "--output-dir", "x"]):
        cli = vars(build_parser().parse_args(["demo", *argv]))
        assert cli.pop("command") == "demo" and cli.pop("func") is not None
        assert cli == vars(add_demo_arguments(argparse.ArgumentParser()).parse_args(argv))
    assert cli["steps"] == 2 and build_parser().parse_args(["demo"]).output_dir == "runs/demo"


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--eval-every", "0"], ["--num-generations", "1"],
                                  ["--sft-steps", "-1"], ["--steps", "ten"]])
def test_demo_refuses_counts_that_would_not_run_as_asked(argv, capsys):
    """`--steps 0` made TRL train by epochs instead; every count is checked before anything is built."""
    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args(["demo", *argv])
    assert raised.value.code == 2
    assert f"argument {argv[0]}" in capsys.readouterr().err


def test_jsonl_logger_appends_each_record(tmp_path):
    path = tmp_path / "run" / "logs.jsonl"
    path.parent.mkdir()
    path.write_text('{"stale": 1}\n')
    callback, state = JsonlLoggerCallback(path), TrainerState()
    assert not path.exists()  # a fresh file per run
    for step, loss in [(1, 0.5), (2, 0.25)]:
        state.global_step = step
        callback.on_log(None, state, TrainerControl(), logs={"loss": loss, "rollplex/decode_s": 0.1})
    callback.on_log(None, state, TrainerControl(), logs=None)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [{"step": 1, "loss": 0.5, "rollplex/decode_s": 0.1},
                       {"step": 2, "loss": 0.25, "rollplex/decode_s": 0.1}]


def test_answer_mention_reward():
    completions = [[{"role": "assistant", "content": "I think it is 3."}], [{"role": "assistant", "content": "B?"}],
                   [{"role": "assistant", "content": "13 balls"}]]
    assert answer_mention_reward(completions, ["<answer>3</answer>", "<answer>B</answer>",
                                               "<answer>3</answer>"]) == [1.0, 1.0, 0.0]


def test_compact_line_reads_the_logs():
    from rollplex_trl.callbacks.console import format_step

    logs = {"loss": 0.0123, "reward": 0.5, "rewards/accuracy_reward/mean": 0.25, "rewards/format_reward/mean": 0.75,
            "kl": 0.002, "rollplex/verify_ref_logp_abs": 3e-7, "rollplex/verify_actor_grad_cos": 1.0,
            "rollplex/verify_within_tolerance": 1.0}
    line = format_step(logs, 3, 8, 2.5)
    assert line == ("[rollplex-trl] step 3/8 · reward 0.500 (accuracy_reward 0.250, format_reward 0.750) · "
                    "loss 0.0123 · kl 0.002 · 2.50 s · audit ok (max |Δ log-prob| 3.0e-07)")
    assert "audit EXCEEDED" in format_step({**logs, "rollplex/verify_within_tolerance": 0.75}, 3, 8)
    assert format_step({"loss": 1.0}, 1, 2) == "[rollplex-trl] step 1/2 · loss 1"


def test_rollplex_console_switch(tiny_qwen2_path, tmp_path):
    """`rollplex_console`: "compact" (default) swaps transformers' progress bar and printer for one line per step,
    once; "trl" keeps TRL's console; anything else is refused naming the field."""
    import pytest
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.callbacks.console import CompactConsole, use_compact_console

    dataset = Dataset.from_dict({"prompt": ["a", "b"]})

    def kinds(console: str, **extra) -> list[type]:
        args = RollplexGRPOConfig(output_dir=str(tmp_path / console), report_to=[], use_cpu=True, max_steps=1,
                                  per_device_train_batch_size=2, num_generations=2, rollplex_console=console, **extra)
        trainer = RollplexGRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=lambda completions, **k: [0.0] * 2,
                                      args=args, train_dataset=dataset)
        use_compact_console(trainer) if console == "compact" else None  # a second call adds nothing
        return [type(c) for c in trainer.callback_handler.callbacks]

    compact = kinds("compact")
    assert compact.count(CompactConsole) == 1 and ProgressCallback not in compact and PrinterCallback not in compact
    assert ProgressCallback in kinds("trl") and CompactConsole not in kinds("trl")
    assert PrinterCallback in kinds("trl", disable_tqdm=True)
    with pytest.raises(ValueError, match="rollplex_console"):
        RollplexGRPOConfig(output_dir=str(tmp_path / "x"), rollplex_console="verbose")

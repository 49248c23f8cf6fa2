"""`rollplex-trl grpo` (TRL's `trl grpo` with RollplexGRPOTrainer), the recipes in examples/recipes/ and the launch
configs in examples/accelerate/: each non-Megatron recipe trains 1 step on a tiny local checkpoint, in this process
(`grpo_script.run`, what each launched process runs) or through the `rollplex-trl grpo` launcher (a subprocess)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollplex_trl import RollplexGRPOConfig, grpo_script
from rollplex_trl.cli import main as cli_main
from rollplex_trl.data import SyntheticVideoConfig, write_synthetic_video_dataset
from rollplex_trl.data.toy import write_toy_dataset

from helpers import require

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "recipes"
LAUNCH_CONFIGS = ROOT / "examples" / "accelerate"
# 1 step, G = 2, 4 completion tokens: seconds per recipe on a CPU
SHORT = ["--max_steps", "1", "--per_device_train_batch_size", "2", "--num_generations", "2",
         "--max_completion_length", "4"]


def _env(tmp_path: Path) -> dict:
    # HF_HOME: accelerate reads its default config from there; a user's own must not change what the test runs
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore", "HF_HOME": str(tmp_path / "hf_home")}


def _free_port() -> str:
    """A port nobody listens on now (other test processes on this machine launch process groups too)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _finite_losses(trainer) -> list[float]:
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert losses and all(math.isfinite(x) for x in losses), trainer.state.log_history
    return losses


@pytest.fixture(scope="module")
def toy_text(tmp_path_factory):
    return write_toy_dataset(tmp_path_factory.mktemp("toy_text"), "text", size=8)


def test_text_recipe(tiny_qwen2_path, toy_text, tmp_path):
    out = tmp_path / "text"
    trainer = grpo_script.run(["--config", str(RECIPES / "text.yaml"), "--model_name_or_path", str(tiny_qwen2_path),
                               "--dataset_name", str(toy_text), "--output_dir", str(out), *SHORT,
                               "--rollplex_share_prefix", "on"])  # the command line overrides the recipe
    assert isinstance(trainer.args, RollplexGRPOConfig) and trainer.args.rollplex_share_prefix == "on"
    assert trainer.plan.share_scoring  # "on" was honoured, not just parsed
    assert trainer.reward_func_names == ["answer_reward", "think_format_reward"]  # dotted path + TRL's name
    assert trainer.state.global_step == 1 and len(_finite_losses(trainer)) == 1
    assert (out / "model.safetensors").exists()


def test_image_recipe(tiny_vl_path, tmp_path):
    data = write_toy_dataset(tmp_path / "toy_image", "image", size=4)
    out = tmp_path / "image"
    trainer = grpo_script.run(["--config", str(RECIPES / "image.yaml"), "--model_name_or_path", str(tiny_vl_path),
                               "--dataset_name", str(data), "--output_dir", str(out), *SHORT])
    assert trainer.state.global_step == 1 and len(_finite_losses(trainer)) == 1
    assert trainer.plan.prepare_images  # image prompts prepared once per prompt (the shared prefix is on)
    assert (out / "model.safetensors").exists()


def test_video_r1_recipe_through_the_launcher(tiny_vl_path, tmp_path):
    """`rollplex-trl grpo --config video_r1.yaml` as typed in a shell: parsed, then `accelerate launch -m
    rollplex_trl.grpo_script` (one process)."""
    annotations = write_synthetic_video_dataset(
        tmp_path / "synthetic", SyntheticVideoConfig(num_samples=2, num_frames=4, height=56, width=56))
    out = tmp_path / "video"
    proc = subprocess.run(
        [sys.executable, "-m", "rollplex_trl.cli", "grpo", "--config", str(RECIPES / "video_r1.yaml"),
         "--model_name_or_path", str(tiny_vl_path), "--video_r1_annotations", str(annotations),
         "--output_dir", str(out), *SHORT, "--rollplex_video_max_frames", "4", "--report_to", "none",
         "--num_processes", "1"],  # a launcher flag among the script's: `accelerate launch` takes it
        cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "Training completed." in proc.stdout and (out / "model.safetensors").exists()
    assert (out / "rollplex_timeline.png").exists()  # the recipe sets rollplex_timeline: true


def test_qwen3_vl_video_recipe_trains_end_to_end(checkpoint_cache, tmp_path):
    """The Qwen3-VL recipe as written (its 2 steps, G 4, T-GRPO at patch granularity) on the tiny local Qwen3-VL and
    the synthetic task at 64 px, as its header's prepare commands make them: it trains, shares the prefix, reuses the
    vision features for the shuffled copies, audits step 0 within tolerance and saves the model."""
    from rollplex_trl.testing.checkpoints import get_checkpoint

    model = get_checkpoint("qwen3-vl", "tiny", cache_dir=checkpoint_cache)
    annotations = write_synthetic_video_dataset(
        tmp_path / "synthetic64", SyntheticVideoConfig(num_samples=4, num_frames=8, height=64, width=64))
    out = tmp_path / "qwen3_vl"
    trainer = grpo_script.run(["--config", str(RECIPES / "video_r1_qwen3_vl.yaml"), "--model_name_or_path",
                               str(model), "--video_r1_annotations", str(annotations), "--output_dir", str(out)])
    assert trainer.model.config.model_type == "qwen3_vl" and trainer.state.global_step == 2
    assert len(_finite_losses(trainer)) == 2
    logged = [r for r in trainer.state.log_history if "loss" in r]
    assert all(r["rollplex/prefix_rows_per_prompt"] > 1 for r in logged)
    assert any(r.get("rollplex/temporal_vision_reused") == 1.0 for r in logged)
    assert [r["rollplex/verify_within_tolerance"] for r in logged if "rollplex/verify_within_tolerance" in r] == [1.0]
    assert (out / "model.safetensors").exists()


@pytest.mark.slow
def test_megatron_recipe_on_two_processes(tiny_vl_path, tmp_path):
    """`rollplex-trl grpo --config video_r1_megatron_tp2.yaml --accelerate_config multi_cpu.yaml`: the Megatron
    backend, t = 2, as a user launches it (2 CPU processes); it logs the live weight sync."""
    require("megatron.core")
    annotations = write_synthetic_video_dataset(
        tmp_path / "synthetic", SyntheticVideoConfig(num_samples=4, num_frames=4, height=56, width=56))
    out = tmp_path / "megatron"
    proc = subprocess.run(
        [sys.executable, "-m", "rollplex_trl.cli", "grpo", "--config", str(RECIPES / "video_r1_megatron_tp2.yaml"),
         "--accelerate_config", str(LAUNCH_CONFIGS / "multi_cpu.yaml"), "--main_process_port", _free_port(),
         "--model_name_or_path", str(tiny_vl_path), "--video_r1_annotations", str(annotations),
         "--output_dir", str(out), "--max_steps", "2", "--rollplex_video_max_frames", "4", "--use_cpu", "true",
         "--rollplex_console", "trl"],  # TRL's dictionaries on the console (the default prints a compact line)
        cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "rollplex/sync_bytes_copied" in proc.stdout and (out / "model.safetensors").exists()


def test_recipes_parse_into_rollplex_config():
    """Every recipe (the Megatron placeholder too: parsed, never run) gives a RollplexGRPOConfig with its
    rollplex_* values, and loads its reward functions."""
    for recipe in sorted(RECIPES.glob("*.yaml")):
        script_args, training_args, model_args, _ = grpo_script.parse(["--config", str(recipe)])
        assert isinstance(training_args, RollplexGRPOConfig), recipe
        assert model_args.model_name_or_path and script_args.reward_funcs, recipe
        assert training_args.use_cpu and not training_args.bf16, recipe  # quick CPU settings, as documented
        assert len(grpo_script.load_reward_funcs(script_args)) == len(script_args.reward_funcs), recipe
    _, video, _, _ = grpo_script.parse(["--config", str(RECIPES / "video_r1.yaml"),
                                        "--rollplex_video_max_frames", "4"])
    assert video.rollplex_video_max_frames == 4 and video.rollplex_video_max_pixels == 3136 and video.rollplex_timeline
    _, megatron, _, _ = grpo_script.parse(["--config", str(RECIPES / "video_r1_megatron_tp2.yaml")])
    assert megatron.rollplex_backend == "megatron" and megatron.rollplex_tensor_parallel_size == 2


def test_bad_reward_name_and_missing_dataset_are_named():
    script_args, training_args, model_args, dataset_args = grpo_script.parse(
        ["--output_dir", "unused", "--reward_funcs", "no_such_reward", "--use_cpu", "true", "--bf16", "false"])
    with pytest.raises(ValueError, match="no_such_reward"):
        grpo_script.load_reward_funcs(script_args)
    with pytest.raises(ValueError, match="video_r1_annotations"):
        grpo_script.load_datasets(script_args, dataset_args, training_args)


def test_recipe_inputs_not_prepared_name_the_command_that_makes_them(tiny_vl_path, tmp_path):
    script_args, _, model_args, _ = grpo_script.parse(
        ["--output_dir", "unused", "--use_cpu", "true", "--bf16", "false", "--model_name_or_path",
         str(tmp_path / "runs" / "checkpoints" / "tiny"), "--video_r1_annotations",
         str(tmp_path / "runs" / "data" / "annotations.jsonl")])
    with pytest.raises(FileNotFoundError, match="rollplex-trl build-checkpoint --output-dir .*runs/checkpoints/tiny"):
        grpo_script.check_inputs_exist(script_args, model_args)
    model_args.model_name_or_path = str(tiny_vl_path)
    with pytest.raises(FileNotFoundError, match="rollplex-trl make-synthetic --output-dir .*runs/data"):
        grpo_script.check_inputs_exist(script_args, model_args)
    script_args.video_r1_annotations = None
    grpo_script.check_inputs_exist(script_args, model_args)  # both there: nothing to say
    model_args.model_name_or_path = "Qwen/Qwen2.5-VL-7B-Instruct"  # a hub id (maybe cached) is the hub's business
    grpo_script.check_inputs_exist(script_args, model_args)


def test_a_mistyped_option_is_named_with_a_suggestion(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "rollplex_trl.cli", "grpo", "--output_dir", str(tmp_path), "--use_cpu", "true",
         "--bf16", "false", "--max_stpes", "3", "--rollplex_overlapp", "on", "--num_processes", "1"],
        cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "unknown option --max_stpes" in proc.stderr and "did you mean --max_steps" in proc.stderr
    assert "did you mean --rollplex_overlap " in proc.stderr
    assert "usage:" not in proc.stderr  # not accelerate's 115 lines of usage


@pytest.mark.parametrize("launcher_flags", [[], ["--num_processes", "1"]])
def test_accelerates_defaults_warning_only_when_the_user_chose_launcher_flags(tmp_path, monkeypatch, caplog,
                                                                              launcher_flags):
    """Without launcher flags (and no accelerate config) `rollplex-trl grpo` is a single-process run: accelerate's
    "`--num_processes` was set to a value of `0`" is noise then; once the user passes one of its flags, accelerate
    speaks as usual. accelerate's own argument validation runs; the launch itself is stubbed."""
    import logging

    import accelerate.commands.launch as accelerate_launch

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no default accelerate config file
    monkeypatch.setattr(accelerate_launch, "launch_command",
                        lambda args: accelerate_launch._validate_launch_command(args))
    with caplog.at_level(logging.WARNING, logger="accelerate.commands.launch"):
        assert grpo_script.launch(["--output_dir", str(tmp_path), "--use_cpu", "true", *launcher_flags]) == 0
    warned = "were not passed to `accelerate launch`" in caplog.text
    assert warned == bool(launcher_flags), caplog.text
    assert logging.getLogger("accelerate.commands.launch").level == logging.NOTSET  # restored


def test_dataset_mixture_from_the_recipe(toy_text, tmp_path):
    """TRL's `datasets:` list in the YAML (DatasetMixtureConfig) is read as `trl grpo` reads it."""
    recipe = tmp_path / "mixture.yaml"
    recipe.write_text(yaml.safe_dump({"output_dir": str(tmp_path), "use_cpu": True, "bf16": False,
                                      "datasets": [{"path": str(toy_text), "split": "train"},
                                                   {"path": str(toy_text), "columns": ["prompt", "solution"]}]}))
    script_args, training_args, _, dataset_args = grpo_script.parse(["--config", str(recipe)])
    train, evaluation = grpo_script.load_datasets(script_args, dataset_args, training_args)
    assert len(train) == 16 and evaluation is None and train.column_names == ["prompt", "solution"]


def test_cli_lists_grpo_and_its_help_lists_rollplex_fields(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--help"])
    assert exit_info.value.code == 0 and "grpo" in capsys.readouterr().out
    assert cli_main(["grpo", "--help"]) == 0  # the short listing: usage first, then the options a run needs
    text = capsys.readouterr().out
    assert text.startswith("usage: rollplex-trl grpo") and len(text.splitlines()) < 400
    for option in ("--config", "--accelerate_config", "--rollplex_share_prefix", "--rollplex_video_max_frames",
                   "--reward_funcs", "--model_name_or_path", "--video_r1_annotations", "--dataset_name",
                   "--resume_from_checkpoint", "--help-all"):
        assert option in text, option
    from rollplex_trl.config import rollplex_field_names

    assert all(f"--{name}" in text for name in rollplex_field_names())
    with pytest.raises(SystemExit) as exit_info:  # every option: TRL's parser
        cli_main(["grpo", "--help-all"])
    text = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--adam_beta1" in text and "--rollplex_share_prefix" in text


def test_make_toy_data_command(tmp_path, capsys):
    from datasets import load_dataset

    assert cli_main(["make-toy-data", "--kind", "image", "--output-dir", str(tmp_path / "img"),
                     "--num-samples", "3"]) == 0
    rows = load_dataset(str(tmp_path / "img"))["train"]
    assert rows.column_names == ["prompt", "image", "solution"] and rows[0]["image"].size == (56, 56)


def test_launch_splits_launcher_and_script_arguments(monkeypatch, tmp_path):
    """As `trl grpo`: unknown flags (and unknown recipe keys) go to `accelerate launch`, the rest to the script."""
    import accelerate.commands.launch as accelerate_launch

    seen = {}
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: seen.setdefault("args", args))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"output_dir": "o", "use_cpu": True, "bf16": False,
                                      "num_processes": 2}))  # a launcher key in the recipe
    assert grpo_script.launch(["--config", str(recipe), "--max_steps", "3", "--accelerate_config",
                               str(LAUNCH_CONFIGS / "multi_cpu.yaml"), "--rollplex_overlap", "off"]) == 0
    args = seen["args"]
    assert args.config_file == str(LAUNCH_CONFIGS / "multi_cpu.yaml") and args.num_processes == 2
    assert args.module and args.training_script == "rollplex_trl.grpo_script"
    assert args.training_script_args == ["--config", str(recipe), "--max_steps", "3", "--rollplex_overlap", "off"]


# ---------------------------------------------------------------------------------------------------------------------
# examples/accelerate/
# ---------------------------------------------------------------------------------------------------------------------

EXPECTED_TYPES = {"multi_cpu.yaml": "MULTI_GPU", "multi_gpu.yaml": "MULTI_GPU", "multi_node.yaml": "MULTI_GPU",
                  "deepspeed_zero2.yaml": "DEEPSPEED", "deepspeed_zero3.yaml": "DEEPSPEED", "fsdp.yaml": "FSDP"}


def test_every_launch_config_loads():
    from accelerate.commands.config.config_args import load_config_from_file

    assert sorted(p.name for p in LAUNCH_CONFIGS.glob("*.yaml")) == sorted(EXPECTED_TYPES)
    for name, distributed_type in EXPECTED_TYPES.items():
        config = load_config_from_file(str(LAUNCH_CONFIGS / name))
        assert str(config.distributed_type).endswith(distributed_type), name
        text = (LAUNCH_CONFIGS / name).read_text()
        assert text.startswith("#") and "rollplex-trl grpo" in text, f"{name}: needs its command in a comment"
    for name in ("deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "fsdp.yaml"):
        assert "switches off" in (LAUNCH_CONFIGS / name).read_text(), name
    assert load_config_from_file(str(LAUNCH_CONFIGS / "deepspeed_zero3.yaml")).deepspeed_config["zero_stage"] == 3
    assert load_config_from_file(str(LAUNCH_CONFIGS / "multi_node.yaml")).num_machines == 2


def test_multi_cpu_config_starts_two_processes():
    """The trap: `--cpu --num_processes 2` takes accelerate's single-process launcher; the multi-process CPU config
    takes torchrun's (multi_gpu) launcher with 2 processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    parser = launch_command_parser()
    args, _, _ = _validate_launch_command(parser.parse_args(
        ["--config_file", str(LAUNCH_CONFIGS / "multi_cpu.yaml"), "-m", "rollplex_trl.grpo_script"]))
    assert args.multi_gpu and args.num_processes == 2 and not args.cpu
    trap, _, _ = _validate_launch_command(parser.parse_args(["--cpu", "--num_processes", "2", "script.py"]))
    assert trap.cpu and not trap.multi_gpu  # -> simple_launcher: one process


def test_two_processes_end_with_identical_weights(tiny_qwen2_path, toy_text, tmp_path):
    """`accelerate launch --config_file examples/accelerate/multi_cpu.yaml` runs the grpo script on 2 CPU processes
    (gloo) for 1 step; both ranks end with the same weights, which moved from the checkpoint's."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    from grpo_digest_worker import weights_digest

    out = tmp_path / "ddp"
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(LAUNCH_CONFIGS / "multi_cpu.yaml"),
         "--main_process_port", _free_port(), str(ROOT / "tests" / "grpo_digest_worker.py"),
         "--config", str(RECIPES / "text.yaml"), "--model_name_or_path", str(tiny_qwen2_path),
         "--dataset_name", str(toy_text), "--output_dir", str(out), *SHORT, "--learning_rate", "0.01",
         "--reward_funcs", "grpo_digest_worker.varied_reward"],
        cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    lines = [(out / f"weights-rank{r}.txt").read_text().split() for r in (0, 1)]
    assert lines[0] == lines[1], lines
    digest, steps, world = lines[0]
    assert (steps, world) == ("1", "2")
    start = weights_digest(AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_path)))
    assert digest != start, "the step did not change the weights: nothing was compared"
    # trainer.end() let go of the process group: gloo's threads ended before the interpreter's teardown, where a
    # live group once aborted a rank after a complete run (rc 134, "terminate called without an active exception")
    for r in (0, 1):
        threads = (out / f"threads-rank{r}.txt").read_text().split()
        assert threads, "no thread list: /proc/self/task unreadable"
        assert not [t for t in threads if "gloo" in t], f"rank {r} still runs process-group threads: {threads}"


def test_make_synthetic_chooses_tasks_and_split(tmp_path, capsys):
    import json

    assert cli_main(["make-synthetic", "--output-dir", str(tmp_path / "lr"), "--num-samples", "4", "--frames", "8",
                     "--size", "56", "--tasks", "left_right", "--split", "heldout"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "lr" / "annotations.jsonl").read_text().splitlines()]
    assert {r["data_source"] for r in rows} == {"rollplex-synthetic/left_right"}
    assert sorted(r["solution"] for r in rows) == ["<answer>A</answer>"] * 2 + ["<answer>B</answer>"] * 2
    train = write_synthetic_video_dataset(tmp_path / "train", SyntheticVideoConfig(
        num_samples=4, num_frames=8, height=56, width=56, tasks=("left_right",)))
    assert train.read_text() != (tmp_path / "lr" / "annotations.jsonl").read_text()  # another split

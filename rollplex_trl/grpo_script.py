"""`rollplex-trl grpo`: TRL's GRPO script (`trl grpo`, `trl/scripts/grpo.py` in TRL 1.16) training with
`RollplexGRPOTrainer`.

The same arguments as `trl grpo`: TRL's `ScriptArguments` (`--dataset_name`, splits, streaming), `ModelConfig`
(`--model_name_or_path`, `--dtype`, LoRA via `--use_peft`), `DatasetMixtureConfig` (a `datasets:` list in the YAML),
`--reward_funcs` (TRL's names or any dotted import path), `--reward_model_name_or_path`, every `GRPOConfig` field, and
a YAML `--config recipe.yaml` whose keys are any of these (the command line overrides them). On top: every
`rollplex_*` field of `RollplexGRPOConfig`, and a Video-R1-format annotation file as the dataset
(`--video_r1_annotations`, read by `rollplex_trl.data.load_video_r1`).

As `trl grpo` does, `rollplex-trl grpo` starts the training through `accelerate launch`: arguments the script does
not know (`--num_processes 2`, `--multi_gpu`, `--config_file ...`, or `--accelerate_config <file or TRL config
name>`) go to the launcher. `python -m rollplex_trl.grpo_script ...` runs the script itself in this process (what
each launched process runs); :func:`run` does the same from Python.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trl import ScriptArguments

SCRIPT_MODULE = "rollplex_trl.grpo_script"


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """TRL's GRPO script arguments, plus a Video-R1-format annotation file as the dataset."""

    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Reward model: a local path to a sequence-classification checkpoint (or a hub id)."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: TRL's `accuracy_reward`, `reasoning_accuracy_reward`, `think_format_reward`, "
            "`get_soft_overlong_punishment`, or any dotted import path (e.g. 'rollplex_trl.data.accuracy_reward' "
            "for Video-R1's accuracy, 'my_lib.rewards.custom_reward')."
        },
    )
    video_r1_annotations: str | None = field(
        default=None,
        metadata={"help": "A Video-R1-format annotation file (JSON list or JSONL; `rollplex-trl make-synthetic` "
                  "writes one) as the training dataset, instead of --dataset_name / datasets."},
    )
    video_r1_data_root: str | None = field(
        default=None,
        metadata={"help": "Folder that `./...` media paths of --video_r1_annotations are resolved against "
                  "(default: the file's folder)."},
    )
    video_r1_on_invalid: str = field(
        default="error",
        metadata={"help": "Invalid Video-R1 rows (unknown problem type, missing file, ...): raise, or drop them "
                  "and report how many.", "choices": ["error", "skip"]},
    )


def reward_registry() -> dict[str, Callable]:
    """TRL's named reward functions (the same names and settings as `trl grpo`)."""
    from rollplex_trl import trl_compat

    return trl_compat.trl_named_rewards()


def load_reward_funcs(script_args: GRPOScriptArguments) -> list:
    """The reward model path (if any) and each `--reward_funcs` entry: a TRL name or a dotted import path."""
    registry = reward_registry()
    reward_funcs: list = []
    if script_args.reward_model_name_or_path:
        reward_funcs.append(script_args.reward_model_name_or_path)
    for name in script_args.reward_funcs or []:
        if name in registry:
            reward_funcs.append(registry[name])
        elif "." in name:
            module_path, func_name = name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())  # as TRL: a module next to the recipe (my_rewards.py) imports
            reward_funcs.append(getattr(importlib.import_module(module_path), func_name))
        else:
            raise ValueError(f"Could not load reward function '{name}'. Expected one of {list(registry)} or a valid "
                             "import path.")
    if not reward_funcs:
        raise ValueError("no reward: pass --reward_funcs (TRL's names or dotted import paths) and/or "
                         "--reward_model_name_or_path")
    return reward_funcs


def load_datasets(script_args: GRPOScriptArguments, dataset_args: Any, training_args: Any) -> tuple[Any, Any]:
    """(train, eval) datasets: a Video-R1 annotation file, TRL's dataset mixture, or `--dataset_name`."""
    from datasets import load_dataset
    from trl import get_dataset

    eval_wanted = training_args.eval_strategy != "no"
    sources = [bool(script_args.video_r1_annotations), bool(dataset_args.datasets), bool(script_args.dataset_name)]
    if script_args.video_r1_annotations:
        if sum(sources) > 1:
            raise ValueError("give one dataset: --video_r1_annotations, or --dataset_name / datasets, not both")
        if eval_wanted:
            raise ValueError("--video_r1_annotations gives a training set only; set --eval_strategy no")
        from rollplex_trl.data import load_video_r1

        return load_video_r1(script_args.video_r1_annotations, script_args.video_r1_data_root,
                             on_invalid=script_args.video_r1_on_invalid), None
    if dataset_args.datasets:  # TRL: `datasets` wins over `dataset_name`
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                               streaming=script_args.dataset_streaming)
    else:
        raise ValueError("Either `datasets`, `dataset_name` or `video_r1_annotations` must be provided.")
    train = dataset[script_args.dataset_train_split]
    return train, dataset[script_args.dataset_test_split] if eval_wanted else None


def check_inputs_exist(script_args: GRPOScriptArguments, model_args: Any) -> None:
    """Before anything loads: a local model folder or annotation file that is not there gets an error naming the
    command that creates it (the recipes expect `build-checkpoint` and `make-synthetic` to have run)."""
    model = model_args.model_name_or_path
    local = os.path.isabs(model) or model.startswith(".") or model.count("/") >= 2  # not a hub id "org/name"
    if local and not os.path.exists(model):
        raise FileNotFoundError(f"--model_name_or_path {model}: no such folder. For the recipes' tiny Qwen2.5-VL run "
                                f"`rollplex-trl build-checkpoint --output-dir {model}` (`--kind qwen2` for a text "
                                "model), or give a downloaded checkpoint.")
    annotations = script_args.video_r1_annotations
    if annotations and not os.path.exists(annotations):
        folder = os.path.dirname(annotations) or "."
        raise FileNotFoundError(f"--video_r1_annotations {annotations}: no such file. The synthetic video task in "
                                f"Video-R1's format: `rollplex-trl make-synthetic --output-dir {folder}` (writes "
                                f"{os.path.join(folder, 'annotations.jsonl')} and its MP4s).")


def main(script_args: GRPOScriptArguments, training_args: Any, model_args: Any, dataset_args: Any):
    """TRL's `grpo.py` `main` with `RollplexGRPOTrainer`; returns the trainer after training and saving."""
    from trl import get_peft_config, get_quantization_config

    from rollplex_trl import RollplexGRPOTrainer

    if model_args.model_name_or_path is None:
        raise ValueError("pass --model_name_or_path (a local checkpoint; `rollplex-trl build-checkpoint --output-dir "
                         "DIR` writes a tiny Qwen2.5-VL, `--kind qwen2` a tiny text model)")
    check_inputs_exist(script_args, model_args)
    reward_funcs = load_reward_funcs(script_args)
    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs
    train_dataset, eval_dataset = load_datasets(script_args, dataset_args, training_args)

    trainer = RollplexGRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    # finish the trackers and close the process group once every rank is done, as TRL's script does
    # (RollplexGRPOTrainer.end: safe for a multi-process exit)
    trainer.end()
    return trainer


def make_parser(prog: str | None = None):
    """TRL's parser for `trl grpo` with `RollplexGRPOConfig` in place of `GRPOConfig`."""
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    from rollplex_trl import RollplexGRPOConfig

    return TrlParser((GRPOScriptArguments, RollplexGRPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def parse(argv: Sequence[str] | None = None) -> tuple:
    """(script_args, training_args, model_args, dataset_args) from `argv` (default: `sys.argv[1:]`)."""
    parser = make_parser(prog="rollplex-trl grpo")
    return tuple(parser.parse_args_and_config(list(argv) if argv is not None else None,
                                              fail_with_unknown_args=False)[:4])


def run(argv: Sequence[str] | None = None):
    """Parse `argv` and train in this process (no launcher); returns the trainer."""
    return main(*parse(argv))


def _subtract_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """`items` without the ordered `subsequence` (TRL's helper: the launcher's flags out of the script's)."""
    rest = iter(subsequence)
    current = next(rest, None)
    result = []
    for item in items:
        if current is not None and item == current:
            current = next(rest, None)
        else:
            result.append(item)
    return result


def script_option_names() -> list[str]:
    """Every `--name` of `rollplex-trl grpo`'s own options (the dataclasses TrlParser is built from)."""
    from dataclasses import fields

    from trl import DatasetMixtureConfig, ModelConfig

    from rollplex_trl import RollplexGRPOConfig

    names = {f"--{f.name}" for cls in (GRPOScriptArguments, RollplexGRPOConfig, ModelConfig, DatasetMixtureConfig)
             for f in fields(cls)}
    return sorted(names | {"--config", "--accelerate_config"})


def unknown_option_message(flags: list[str]) -> str:
    import difflib

    known = script_option_names()
    lines = []
    for flag in flags:
        close = difflib.get_close_matches(flag.replace("-", "_"), [k.replace("-", "_") for k in known], n=3)
        hint = f"; did you mean {' or '.join('--' + c.lstrip('_') for c in close)}?" if close else ""
        lines.append(f"rollplex-trl grpo: unknown option {flag} (neither a script option nor an `accelerate launch` "
                     f"option){hint}")
    return "\n".join(lines) + "\n`rollplex-trl grpo --help` lists the options."


# the TRL / transformers fields a first run sets; `--help-all` lists every option
COMMON_OPTIONS = ("model_name_or_path", "output_dir", "max_steps", "num_generations", "per_device_train_batch_size",
                  "max_completion_length", "learning_rate", "beta", "bf16", "use_cpu", "gradient_checkpointing",
                  "save_steps", "resume_from_checkpoint", "report_to", "use_vllm", "vllm_mode")


def short_help() -> str:
    """`rollplex-trl grpo --help`: usage, the recipe and launcher options, the script's and Rollplex's own options
    and the common TRL ones, each with its help; `--help-all` prints TRL's full listing (1,600 lines)."""
    import textwrap
    from dataclasses import MISSING, fields

    from trl import ModelConfig

    from rollplex_trl import RollplexGRPOConfig
    from rollplex_trl.config import rollplex_field_names

    def describe(f) -> list[str]:
        default = "" if f.default is MISSING else f" (default: {f.default!r})"
        text = (f.metadata.get("help") or "").strip() + default
        return [f"  --{f.name}", *textwrap.wrap(text, 110, initial_indent=" " * 6, subsequent_indent=" " * 6)]

    config_fields = {f.name: f for f in fields(RollplexGRPOConfig)} | {f.name: f for f in fields(ModelConfig)}
    lines = ["usage: rollplex-trl grpo [--config RECIPE.yaml] [--accelerate_config NAME|PATH] [--OPTION VALUE ...]",
             "", "TRL's `trl grpo` with RollplexGRPOTrainer, started through `accelerate launch` (its flags, e.g.",
             "--num_processes, are passed on). Options come from the command line or the YAML recipe.", "",
             "Recipe and launcher:",
             "  --config FILE", "      a YAML recipe (examples/recipes/); command-line options override its keys",
             "  --accelerate_config NAME|PATH",
             "      an accelerate config (examples/accelerate/, or a name TRL ships: multi_gpu, zero2, ...)", "",
             "Data and rewards:"]
    for f in fields(GRPOScriptArguments):
        lines += describe(f)
    lines += ["", "Common training options (TRL / transformers):"]
    for name in COMMON_OPTIONS:
        lines += describe(config_fields[name])
    lines += ["", "Rollplex options:"]
    for name in rollplex_field_names():
        lines += describe(config_fields[name])
    lines += ["", "Every option (all of TRL's GRPOConfig, transformers' TrainingArguments, ModelConfig): "
              "rollplex-trl grpo --help-all"]
    return "\n".join(lines)


def launch(argv: Sequence[str]) -> int:
    """`rollplex-trl grpo ARGS`: split ARGS into the script's and `accelerate launch`'s, as `trl grpo` does, and
    start `accelerate launch [launcher args] -m rollplex_trl.grpo_script [script args]`.

    `-m` (not the file's path) so that each process imports the installed package, not the folder of the file.
    """
    from accelerate.commands.launch import launch_command, launch_command_parser

    from rollplex_trl import trl_compat
    from rollplex_trl.trl_compat import resolve_accelerate_config_argument

    all_args = list(argv)
    if any(a in ("-h", "--help") for a in all_args):
        print(short_help())
        return 0
    if "--help-all" in all_args:  # TRL's parser prints every option and exits
        all_args = [a if a != "--help-all" else "--help" for a in all_args]
    # the unknown strings are the launcher's
    *_, config_remaining, cli_remaining = make_parser(prog="rollplex-trl grpo").parse_args_and_config(
        all_args, return_remaining_strings=True, separate_remaining_strings=True)
    launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
    script_args = _subtract_subsequence(all_args, cli_remaining)
    # a flag neither parser knows (a typo) is named here, with a suggestion, instead of accelerate's full usage.
    # argparse's `_actions` (stdlib, unchanged since Python 3.2) lists the launcher's option strings.
    launcher_options = {o for action in launch_command_parser()._actions for o in action.option_strings}
    flags = [a.split("=", 1)[0] for a in launch_args if a.startswith("--") and a.split("=", 1)[0] not in
             launcher_options]
    if flags:
        print(unknown_option_message(flags), file=sys.stderr)
        return 2
    chosen = {a.split("=", 1)[0] for a in launch_args}
    quiet = (contextlib.nullcontext() if chosen & set(trl_compat.ACCELERATE_DEFAULTED_FLAGS)
             else trl_compat.quiet_accelerate_launch_defaults())
    try:
        with quiet:
            launch_command(launch_command_parser().parse_args([*launch_args, "-m", SCRIPT_MODULE, *script_args]))
    except subprocess.CalledProcessError as error:  # the single-process launcher: the script failed (its traceback
        return error.returncode or 1  # is already printed)
    return 0


if __name__ == "__main__":
    run()

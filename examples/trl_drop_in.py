"""TRL's GRPO script (`trl/scripts/grpo.py`, TRL 1.16) with one change: the trainer and config classes.

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer   # was: from trl import GRPOConfig, GRPOTrainer

Everything else is TRL's: `TrlParser` with every `GRPOConfig` field (and every `rollplex_*` field) on the command line
or in a YAML `--config`, `ModelConfig` (`--model_name_or_path`, `--dtype`, LoRA via `--use_peft`), reward functions
by name or dotted import path, `trainer.train()` then `trainer.save_model()`. On text and image datasets
`RollplexGRPOTrainer` runs TRL's own code paths and is tested to train like `trl.GRPOTrainer` step for step.

Two additions so that it runs offline on a laptop: without `--model_name_or_path` it uses a locally built tiny Qwen2
(`rollplex_trl.testing.checkpoints.get_checkpoint`; no model hub), and without `--dataset_name` it trains on a toy
text dataset built here (sums: "What is 3 + 4?"), `--toy_dataset image` on a toy image dataset (a coloured square:
"What colour is the square?", needs a Qwen2.5-VL checkpoint, which is then the default).

Run (CPU, a few seconds of training):
    HF_HUB_OFFLINE=1 .venv/bin/python examples/trl_drop_in.py --output_dir runs/drop_in --max_steps 2 \\
        --per_device_train_batch_size 4 --num_generations 4 --max_completion_length 16 --use_cpu --bf16 false
    # your own data: any dataset `datasets.load_dataset` reads, e.g. a folder of JSONL files with a "prompt" column
    ... --dataset_name data/my_prompts --reward_funcs my_rewards.correctness --model_name_or_path path/to/checkpoint
"""

import argparse
import importlib
import os
import random
import sys
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # checkpoints are local: get_checkpoint(...) or --model_name_or_path

from trl import ScriptArguments  # noqa: E402

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220), "yellow": (230, 210, 20)}


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """Script arguments for the GRPO training script (TRL's, plus `toy_dataset` for an offline run)."""

    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Reward model: a local path to a sequence-classification checkpoint."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: `think_format_reward` (TRL's), `answer_reward`, `length_reward` (this "
            "script's toy rewards, the default), or any dotted import path (e.g. 'my_lib.rewards.custom_reward')."
        },
    )
    toy_dataset: str = field(
        default="text",
        metadata={"help": "Without --dataset_name: the built-in toy dataset.", "choices": ["text", "image"]},
    )
    toy_size: int = field(default=64, metadata={"help": "Rows of the built-in toy dataset."})


def completion_text(completion) -> str:
    """The text of a completion: conversational (a list of messages) or plain."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def answer_reward(completions, solution, **kwargs) -> list[float]:
    """1.0 when the toy row's answer (a number or a colour) is one of the completion's words."""
    return [1.0 if sol in completion_text(c).lower().replace(".", " ").split() else 0.0
            for c, sol in zip(completions, solution, strict=True)]


def length_reward(completions, **kwargs) -> list[float]:
    """TRL's quickstart reward: completions close to 20 characters score highest."""
    return [-abs(20 - len(completion_text(c))) / 20 for c in completions]


def toy_dataset(kind: str, size: int, seed: int):
    """A small offline dataset in TRL's conversational format, with a `solution` column for `answer_reward`."""
    from datasets import Dataset

    rng = random.Random(seed)
    if kind == "text":
        rows = []
        for _ in range(size):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}],
                         "solution": str(a + b)})
        return Dataset.from_list(rows)
    from PIL import Image

    names = list(COLOURS)
    prompts, images, solutions = [], [], []
    for _ in range(size):
        name = rng.choice(names)
        image = Image.new("RGB", (56, 56), (255, 255, 255))
        image.paste(COLOURS[name], (14, 14, 42, 42))
        prompts.append([{"role": "user", "content": "What colour is the square? Answer with one word."}])
        images.append(image)
        solutions.append(name)
    return Dataset.from_dict({"prompt": prompts, "image": images, "solution": solutions})


def main(script_args, training_args, model_args):
    from datasets import load_dataset
    from trl import get_peft_config, get_quantization_config
    from trl.rewards import think_format_reward

    from rollplex_trl import RollplexGRPOTrainer  # was: from trl import GRPOTrainer

    reward_funcs_registry = {
        "think_format_reward": think_format_reward,
        "answer_reward": answer_reward,
        "length_reward": length_reward,
    }

    # Get the reward models and functions
    reward_funcs = []
    if script_args.reward_model_name_or_path:
        reward_funcs.append(script_args.reward_model_name_or_path)
    for func_name in script_args.reward_funcs or (["answer_reward", "length_reward"] if not reward_funcs else []):
        if func_name in reward_funcs_registry:
            reward_funcs.append(reward_funcs_registry[func_name])
        elif "." in func_name:
            module_path, func_name = func_name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_path)
            reward_funcs.append(getattr(module, func_name))
        else:
            raise ValueError(f"Could not load reward function '{func_name}'. Expected one of "
                             f"{list(reward_funcs_registry)} or a valid import path.")

    # The model: a local checkpoint (no model hub)
    model = model_args.model_name_or_path
    if model is None:
        from rollplex_trl.testing.checkpoints import get_checkpoint

        kind = "qwen2_5_vl" if script_args.toy_dataset == "image" else "qwen2"
        model = str(get_checkpoint(kind, "tiny"))
        print(f"no --model_name_or_path: using the local tiny {kind} checkpoint {model}")
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    # Load the dataset
    if script_args.dataset_name:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                               streaming=script_args.dataset_streaming)
    else:
        dataset = {script_args.dataset_train_split: toy_dataset(script_args.toy_dataset, script_args.toy_size,
                                                                training_args.seed)}

    # Initialize the GRPO trainer
    trainer = RollplexGRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )

    # Train the model
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")

    # Save the model and the training state (its log_history has every logged step)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    trainer.end()  # finish the trackers and close the process group once every rank is done


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    from trl import ModelConfig, TrlParser

    from rollplex_trl import RollplexGRPOConfig  # was: from trl import GRPOConfig

    return TrlParser((GRPOScriptArguments, RollplexGRPOConfig, ModelConfig), prog=prog)


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args = parser.parse_args_and_config(fail_with_unknown_args=False)[:3]
    main(script_args, training_args, model_args)

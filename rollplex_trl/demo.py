"""The main job: a short GRPO training of a local Qwen2.5-VL on the synthetic video task.

Builds (or reuses) a local Qwen2.5-VL checkpoint, writes the synthetic video task (real MP4 clips, Video-R1-format
annotations), trains a few GRPO steps with ``RollplexGRPOTrainer`` and the Video-R1 rewards, and prints where the
checkpoint and logs went. ``rollplex-trl demo``, ``bash scripts/demo.sh`` and ``examples/demo.py`` all run
:func:`run_demo` with the options of :func:`add_demo_arguments`.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path


def answer_mention_reward(completions, solution, **kwargs) -> list[float]:
    """Demo-only shaping reward: 1.0 when the correct answer (e.g. "3" or "B") appears anywhere in the completion.

    A freshly initialised tiny model never writes `<answer>` tags, so Video-R1's accuracy and format rewards are 0
    for every sample and GRPO has no signal. This dense reward gives the demo a learning signal; real training uses
    `accuracy_reward` and `format_reward` only.
    """
    from rollplex_trl.data import completion_text, extract_answer

    rewards = []
    for completion, sol in zip(completions, solution, strict=True):
        answer = extract_answer(sol)
        words = re.findall(r"[A-Za-z0-9]+", completion_text(completion))
        rewards.append(1.0 if answer and answer in words else 0.0)
    return rewards


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The main job's options (``rollplex-trl demo --help``)."""
    parser.add_argument("--output-dir", default="runs/demo", help="where data, checkpoints and logs go")
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="size of the local Qwen2.5-VL")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--num-samples", type=int, default=16, help="synthetic video clips to generate")
    parser.add_argument("--num-generations", type=int, default=4, help="completions per prompt (G)")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="prompts per optimizer step")
    parser.add_argument("--max-completion-length", type=int, default=48)
    parser.add_argument("--frames", type=int, default=8, help="frames per clip (and most frames sampled)")
    parser.add_argument("--size", type=int, default=112, help="clip height and width in pixels")
    parser.add_argument("--max-pixels", type=int, default=56 * 56, help="pixels per sampled frame")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient (Video-R1 uses 0.04)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", default="count,direction,first_appeared",
                        help="synthetic task types, comma-separated, from count, direction, first_appeared, "
                        "left_right (left_right needs the frames in order)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    return parser


def run_demo(args: argparse.Namespace) -> int:
    """Run the main job with the options of :func:`add_demo_arguments`; returns the exit code (0)."""
    import torch

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.callbacks.console import use_compact_console
    from rollplex_trl.callbacks.jsonl import JsonlLoggerCallback
    from rollplex_trl.data import (
        SyntheticVideoConfig,
        accuracy_reward,
        format_reward,
        load_video_r1,
        write_synthetic_video_dataset,
    )
    from rollplex_trl.testing.checkpoints import get_checkpoint

    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, args.threads or (os.cpu_count() or 1)))

    print(f"[rollplex-trl] building the local Qwen2.5-VL '{args.preset}' checkpoint (cached after the first run)")
    model_path = get_checkpoint("qwen2_5_vl", args.preset)
    print(f"[rollplex-trl] writing the synthetic video task ({args.num_samples} MP4 clips) to {out / 'data'}")
    annotations = write_synthetic_video_dataset(
        out / "data",
        SyntheticVideoConfig(num_samples=args.num_samples, seed=args.seed, num_frames=args.frames,
                             height=args.size, width=args.size, tasks=tuple(args.tasks.split(","))),
    )
    dataset = load_video_r1(annotations)

    log_file = out / "logs.jsonl"
    config = RollplexGRPOConfig(
        output_dir=str(out / "checkpoints"),
        max_steps=args.steps,
        per_device_train_batch_size=args.num_generations * args.prompts_per_step,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        beta=args.beta,
        logging_steps=1,
        save_steps=args.steps,
        save_strategy="steps",
        report_to=[],
        seed=args.seed,
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        rollplex_timeline=True,
        rollplex_video_max_frames=args.frames,
        rollplex_video_max_pixels=args.max_pixels,
        rollplex_video_min_pixels=min(args.max_pixels, 4 * 28 * 28),
    )
    trainer = RollplexGRPOTrainer(
        model=str(model_path),
        reward_funcs=[accuracy_reward, format_reward, answer_mention_reward],
        args=config,
        train_dataset=dataset,
        callbacks=[JsonlLoggerCallback(log_file)],
    )
    use_compact_console(trainer)  # one line per step; the full logs go to logs.jsonl
    t0 = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - t0
    final = Path(config.output_dir) / f"checkpoint-{trainer.state.global_step}"
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    print(f"[rollplex-trl] trained {trainer.state.global_step} steps in {elapsed:.1f} s; "
          f"mean reward per step: {', '.join(f'{r:.3f}' for r in rewards)}")
    _ask_about_first_clip(trainer, config, dataset)
    print(f"[rollplex-trl] done. checkpoint: {final} | logs: {log_file}")
    return 0


def _ask_about_first_clip(trainer, config, dataset) -> None:
    """Ask the trained model the first clip's question, its frames sampled as in training (PyAV, not torchcodec)."""
    from rollplex_trl.data import extract_answer
    from rollplex_trl.inference import ask_about_video, sampling_from_config

    row = dataset[0]
    answer = ask_about_video(trainer.model, trainer.processing_class, row["video"], row["prompt"],
                             sampling=sampling_from_config(config), max_new_tokens=config.max_completion_length)
    print(f"[rollplex-trl] asked the trained model about {Path(row['video']).name}: {answer[:200]!r} "
          f"(solution: {extract_answer(row['solution'])})")


def main(argv: list[str] | None = None) -> int:
    """``python -m rollplex_trl.demo`` / ``examples/demo.py``: the same options as ``rollplex-trl demo``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return run_demo(add_demo_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""The `rollplex-trl` command.

- `rollplex-trl demo`: the main job. Builds a local Qwen2.5-VL checkpoint and the synthetic video task (real MP4
  files), trains a few GRPO steps with `RollplexGRPOTrainer`, and says where the checkpoint and logs went.
- `rollplex-trl build-checkpoint`: writes a local checkpoint (tiny/small Qwen2.5-VL or Qwen2).
- `rollplex-trl make-synthetic`: writes the synthetic video task in Video-R1 format.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

logger = logging.getLogger("rollplex_trl")


def answer_mention_reward(completions, solution, **kwargs) -> list[float]:
    """Demo-only shaping reward: 1.0 when the correct answer (e.g. "3" or "B") appears anywhere in the completion.

    A freshly initialised tiny model never writes `<answer>` tags, so Video-R1's accuracy and format rewards are 0
    for every sample and GRPO has no signal. This dense reward gives the demo a learning signal; real training uses
    `accuracy_reward` and `format_reward` only.
    """
    import re

    from rollplex_trl.data import completion_text, extract_answer

    rewards = []
    for completion, sol in zip(completions, solution, strict=True):
        answer = extract_answer(sol)
        words = re.findall(r"[A-Za-z0-9]+", completion_text(completion))
        rewards.append(1.0 if answer and answer in words else 0.0)
    return rewards


def _demo(args: argparse.Namespace) -> int:
    import torch
    from transformers import TrainerCallback

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
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
                             height=args.size, width=args.size),
    )
    dataset = load_video_r1(annotations)

    log_file = out / "logs.jsonl"
    log_file.unlink(missing_ok=True)

    class JsonlLogger(TrainerCallback):
        """Append every log record (loss, rewards, rollplex/* metrics) to logs.jsonl."""

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs:
                with log_file.open("a") as f:
                    f.write(json.dumps({"step": state.global_step, **logs}) + "\n")

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
        callbacks=[JsonlLogger()],
    )
    t0 = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - t0
    final = Path(config.output_dir) / f"checkpoint-{trainer.state.global_step}"
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    print(f"[rollplex-trl] trained {trainer.state.global_step} steps in {elapsed:.1f} s; "
          f"mean reward per step: {', '.join(f'{r:.3f}' for r in rewards)}")
    print(f"[rollplex-trl] done. checkpoint: {final} | logs: {log_file}")
    return 0


def _build_checkpoint(args: argparse.Namespace) -> int:
    from rollplex_trl.testing.checkpoints import build_checkpoint

    path = build_checkpoint(args.output_dir, kind=args.kind, preset=args.preset, seed=args.seed)
    print(path)
    return 0


def _make_synthetic(args: argparse.Namespace) -> int:
    from rollplex_trl.data import SyntheticVideoConfig, write_synthetic_video_dataset

    path = write_synthetic_video_dataset(
        args.output_dir,
        SyntheticVideoConfig(num_samples=args.num_samples, seed=args.seed, num_frames=args.frames,
                             height=args.size, width=args.size),
    )
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollplex-trl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="main job: short GRPO training on the synthetic video task")
    demo.add_argument("--output-dir", default="runs/demo", help="where data, checkpoints and logs go")
    demo.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="size of the local Qwen2.5-VL")
    demo.add_argument("--steps", type=int, default=8, help="optimizer steps")
    demo.add_argument("--num-samples", type=int, default=16, help="synthetic video clips to generate")
    demo.add_argument("--num-generations", type=int, default=4, help="completions per prompt (G)")
    demo.add_argument("--prompts-per-step", type=int, default=2, help="prompts per optimizer step")
    demo.add_argument("--max-completion-length", type=int, default=48)
    demo.add_argument("--frames", type=int, default=8, help="frames per clip (and most frames sampled)")
    demo.add_argument("--size", type=int, default=112, help="clip height and width in pixels")
    demo.add_argument("--max-pixels", type=int, default=56 * 56, help="pixels per sampled frame")
    demo.add_argument("--learning-rate", type=float, default=1e-4)
    demo.add_argument("--beta", type=float, default=0.04, help="KL coefficient (Video-R1 uses 0.04)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    demo.set_defaults(func=_demo)

    ckpt = sub.add_parser("build-checkpoint", help="write a local checkpoint")
    ckpt.add_argument("--output-dir", required=True)
    ckpt.add_argument("--kind", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen2"])
    ckpt.add_argument("--preset", default="tiny", choices=["tiny", "small", "3b"])
    ckpt.add_argument("--seed", type=int, default=0)
    ckpt.set_defaults(func=_build_checkpoint)

    syn = sub.add_parser("make-synthetic", help="write the synthetic video task (MP4 + Video-R1 JSONL)")
    syn.add_argument("--output-dir", required=True)
    syn.add_argument("--num-samples", type=int, default=64)
    syn.add_argument("--frames", type=int, default=16)
    syn.add_argument("--size", type=int, default=112)
    syn.add_argument("--seed", type=int, default=0)
    syn.set_defaults(func=_make_synthetic)
    from rollplex_trl.memory.cli import register_cli as _memory
    _memory(sub)
    from rollplex_trl.sharding.cli import register_cli as _sharding
    _sharding(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

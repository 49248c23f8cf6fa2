"""The main job: Video-R1's pipeline in miniature, on a video task that needs the frames in order.

1. builds (or reuses) a local Qwen2.5-VL checkpoint (the ``demo`` preset: random weights, no model hub; ``--family
   qwen3-vl``: a Qwen3-VL of the same sizes);
2. writes the synthetic ``left_right`` task ("does the blue square move left or right?") as real MP4 clips, a train
   and a held-out split with disjoint scenes;
3. a supervised cold start with TRL's ``SFTTrainer`` on ``<think>…</think><answer>…</answer>`` answers
   (``rollplex_trl.data.sft``);
4. GRPO with ``RollplexGRPOTrainer`` and Video-R1's accuracy and format rewards, the held-out accuracy measured
   every ``--eval-every`` steps;
5. prints the held-out accuracy of the random, the SFT and the GRPO model as a table, and writes ``results.json``,
   ``learning_curve.png`` (reward and held-out accuracy per step) and the phase timeline.

Held-out accuracy is Video-R1's accuracy reward on the held-out questions, for answers sampled at the rollout
temperature (``--eval-samples`` per question: what the training reward measures) and for the greedy answer.
``rollplex-trl demo``, ``bash scripts/demo.sh`` and ``examples/demo.py`` all run :func:`run_demo` with the options
of :func:`add_demo_arguments`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# TRL's log key of the accuracy reward's mean over a step's completions.
ACCURACY_KEY = "rewards/accuracy_reward/mean"
# T-GRPO's log key of the accuracy of the completions sampled on the shuffled clips.
SHUFFLED_KEY = "rollplex/temporal_shuffled_accuracy"


def answer_mention_reward(completions, solution, **kwargs) -> list[float]:
    """Shaping reward for runs without a cold start: 1.0 when the correct answer (e.g. "3" or "B") appears anywhere
    in the completion.

    A freshly initialised model never writes `<answer>` tags, so Video-R1's accuracy and format rewards are 0 for
    every sample and GRPO has no signal (the quickstart notebooks use it for that reason). The main job does not
    need it: its SFT cold start teaches the format first.
    """
    from rollplex_trl.data import completion_text, extract_answer

    rewards = []
    for completion, sol in zip(completions, solution, strict=True):
        answer = extract_answer(sol)
        words = re.findall(r"[A-Za-z0-9]+", completion_text(completion))
        rewards.append(1.0 if answer and answer in words else 0.0)
    return rewards


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum` (``--steps 0`` would make TRL train by epochs instead)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The main job's options (``rollplex-trl demo --help``)."""
    parser.add_argument("--output-dir", default="runs/demo", help="where data, checkpoints and logs go")
    parser.add_argument("--preset", default="demo", choices=["tiny", "demo", "small"],
                        help="size of the local model")
    from rollplex_trl.models.families import FAMILIES

    parser.add_argument("--family", default="qwen2.5-vl", choices=list(FAMILIES),
                        help="model family of the local checkpoint (models/families.py)")
    parser.add_argument("--sft-steps", type=_at_least(0), default=200,
                        help="supervised cold-start steps (0: no cold start)")
    parser.add_argument("--sft-learning-rate", type=float, default=5e-4)
    parser.add_argument("--steps", type=_at_least(1), default=100, help="GRPO optimizer steps")
    parser.add_argument("--num-samples", type=_at_least(1), default=256, help="training clips to generate")
    parser.add_argument("--heldout-samples", type=_at_least(1), default=64, help="held-out clips (disjoint scenes)")
    parser.add_argument("--num-generations", type=_at_least(2), default=8, help="completions per prompt (G)")
    parser.add_argument("--prompts-per-step", type=_at_least(1), default=8, help="prompts per optimizer step")
    parser.add_argument("--max-completion-length", type=_at_least(1), default=24)
    parser.add_argument("--frames", type=_at_least(2), default=8, help="frames per clip (and most frames sampled)")
    parser.add_argument("--size", type=_at_least(28), default=112, help="clip height and width in pixels")
    parser.add_argument("--max-pixels", type=_at_least(784), default=None,
                        help="pixels per sampled frame (default: 2 x 2 merged tokens, 56 x 56 on Qwen2.5-VL, 64 x 64 "
                        "on Qwen3-VL)")
    parser.add_argument("--learning-rate", type=float, default=5e-4, help="GRPO learning rate")
    parser.add_argument("--beta", type=float, default=0.0,
                        help="KL coefficient (TRL's default 0; Video-R1 uses 0.04: held-out 0.863 vs 0.883 at seed 0)")
    parser.add_argument("--temporal", action=argparse.BooleanOptionalAction, default=True,
                        help="T-GRPO (Video-R1's --temporal true): also sample G/2 completions on the clip with its "
                        "frames shuffled; correct answers on the ordered clip get +0.3 where order helped")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", default="left_right",
                        help="synthetic task types, comma-separated, from count, direction, first_appeared, "
                        "left_right (left_right needs the frames in order)")
    parser.add_argument("--eval-every", type=_at_least(1), default=25, help="GRPO steps between held-out evaluations")
    parser.add_argument("--eval-samples", type=_at_least(1), default=4,
                        help="sampled answers per held-out question (temperature 1, as in the rollouts)")
    parser.add_argument("--threads", type=_at_least(0), default=0, help="torch threads (0: all cores)")
    return parser


def run_demo(args: argparse.Namespace) -> int:
    """Run the main job with the options of :func:`add_demo_arguments`; returns the exit code (0)."""
    import torch

    from rollplex_trl.data import VideoSamplingConfig
    from rollplex_trl.models.families import family_named, frame_factor
    from rollplex_trl.testing.checkpoints import get_checkpoint

    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, args.threads or (os.cpu_count() or 1)))
    started = time.perf_counter()

    family = family_named(args.family)
    print(f"[rollplex-trl] building the local {family.name} '{args.preset}' checkpoint (cached after the first run)")
    model_path = get_checkpoint(family.model_type, args.preset)
    train, heldout = _write_data(args, out)
    random_model, processor = _load(model_path)
    factor = frame_factor(processor) or 28  # one merged token is factor x factor pixels
    if args.max_pixels is None:
        args.max_pixels = (2 * factor) ** 2
    sampling = VideoSamplingConfig(max_frames=args.frames, max_pixels=args.max_pixels,
                                   min_pixels=min(args.max_pixels, 4 * factor**2), image_factor=factor)
    evaluate = _Evaluator(heldout, sampling, args, processor)

    torch.manual_seed(args.seed)
    table = {"random": evaluate.table_row(random_model)}
    start_model = model_path
    if args.sft_steps > 0:
        start_model = _cold_start(model_path, train, sampling, args, out / "sft")
        table["SFT"] = evaluate.table_row(_load(start_model)[0])
    trainer, steps, scores = _grpo(start_model, train, evaluate, args, out)
    table["GRPO"] = evaluate.table_row(trainer.model, sampled=scores[-1])
    curve = [(0, table["SFT" if args.sft_steps > 0 else "random"]["sampled"])]
    curve += [(step, score.accuracy) for step, score in zip(steps, scores, strict=True)]

    final = Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
    rewards = [(r["step"], r[ACCURACY_KEY]) for r in trainer.state.log_history if ACCURACY_KEY in r]
    shuffled = [(r["step"], r[SHUFFLED_KEY]) for r in trainer.state.log_history if SHUFFLED_KEY in r]
    options = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))}  # not the CLI's `func`
    results = {"args": options, "heldout": table, "heldout_curve": curve, "accuracy_reward_curve": rewards,
               "shuffled_accuracy_curve": shuffled,
               "seconds": round(time.perf_counter() - started, 1)}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(format_table(table, evaluate.questions, args.eval_samples))
    pictures = [p for p in (plot_learning_curve(rewards, curve, out / "learning_curve.png", shuffled),
                            Path(trainer.args.output_dir) / "rollplex_timeline.png") if p and Path(p).exists()]
    print(f"[rollplex-trl] {results['seconds']:.0f} s in all. pictures: {', '.join(map(str, pictures)) or 'none'}")
    print(f"[rollplex-trl] done. checkpoint: {final} | logs: {out / 'logs.jsonl'} | results: {out / 'results.json'}")
    return 0


def _write_data(args: argparse.Namespace, out: Path):
    from rollplex_trl.data import SyntheticVideoConfig, load_video_r1, write_synthetic_video_dataset

    splits = {}
    for split, count in (("train", args.num_samples), ("heldout", args.heldout_samples)):
        print(f"[rollplex-trl] writing the synthetic video task, {split} split ({count} MP4 clips) to "
              f"{out / 'data' / split}")
        config = SyntheticVideoConfig(num_samples=count, seed=args.seed, num_frames=args.frames, height=args.size,
                                      width=args.size, tasks=tuple(args.tasks.split(",")), split=split)
        splits[split] = load_video_r1(write_synthetic_video_dataset(out / "data" / split, config))
    return splits["train"], splits["heldout"]


def _load(path: Path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText.from_pretrained(path), AutoProcessor.from_pretrained(path)


class _Evaluator:
    """Held-out accuracy of a model: sampled answers (the training reward's measure) and the greedy answer."""

    def __init__(self, heldout: Any, sampling: Any, args: argparse.Namespace, processor: Any) -> None:
        self.heldout, self.sampling, self.args, self.processor = heldout, sampling, args, processor
        self.questions = len(heldout)

    def sampled(self, model: Any) -> Any:
        from rollplex_trl.evaluation import heldout_accuracy

        return heldout_accuracy(model, self.processor, self.heldout, self.sampling,
                                max_new_tokens=self.args.max_completion_length, samples=self.args.eval_samples,
                                do_sample=True)

    def table_row(self, model: Any, sampled: Any = None) -> dict[str, float]:
        """The model's row of the table; `sampled`: its sampled score if already measured (the curve's last point)."""
        from rollplex_trl.evaluation import heldout_accuracy

        sampled = sampled or self.sampled(model)
        greedy = heldout_accuracy(model, self.processor, self.heldout, self.sampling,
                                  max_new_tokens=self.args.max_completion_length)
        return {"sampled": sampled.accuracy, "greedy": greedy.accuracy, "format": sampled.format}



def _cold_start(model_path: Path, train: Any, sampling: Any, args: argparse.Namespace, out: Path) -> Path:
    """Supervised fine-tune with TRL's SFTTrainer on the format Video-R1's rewards check; returns the saved model."""
    import torch
    from trl import SFTConfig, SFTTrainer

    from rollplex_trl.callbacks.console import use_compact_console
    from rollplex_trl.data.sft import VideoSFTCollator
    from rollplex_trl.trainers.media import SAMPLING_CONFIG_KEY

    model, processor = _load(model_path)
    config = SFTConfig(
        output_dir=str(out), max_steps=args.sft_steps, per_device_train_batch_size=8,
        learning_rate=args.sft_learning_rate, lr_scheduler_type="constant", logging_steps=max(1, args.sft_steps // 4),
        save_strategy="no", report_to=[], seed=args.seed, bf16=False, use_cpu=not torch.cuda.is_available(),
        remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True}, dataloader_num_workers=0,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=processor,
                         data_collator=VideoSFTCollator(processor, sampling))
    use_compact_console(trainer)
    print(f"[rollplex-trl] SFT cold start: {args.sft_steps} steps of TRL's SFTTrainer")
    t0 = time.perf_counter()
    trainer.train()
    # the frame sampling goes into the model's config as the GRPO trainer records it, so `rollplex-trl ask` on the
    # SFT model samples the frames it was trained on
    setattr(model.config, SAMPLING_CONFIG_KEY, dataclasses.asdict(sampling))
    trainer.save_model(str(out / "model"))
    processor.save_pretrained(str(out / "model"))
    print(f"[rollplex-trl] SFT done in {time.perf_counter() - t0:.1f} s; model: {out / 'model'}")
    return out / "model"


def _grpo(start_model: Path, train: Any, evaluate: _Evaluator, args: argparse.Namespace, out: Path):
    import torch
    from transformers import TrainerCallback

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.callbacks.jsonl import JsonlLoggerCallback
    from rollplex_trl.data import accuracy_reward, format_reward

    steps: list[int] = []  # the GRPO steps after which the held-out accuracy was measured (the last one included)
    scores: list[Any] = []

    class HeldoutEvery(TrainerCallback):
        def on_step_end(self, _args, state, control, model=None, **kwargs):
            if state.global_step % args.eval_every == 0 or state.global_step == state.max_steps:
                steps.append(state.global_step)
                scores.append(evaluate.sampled(model))
                print(f"[rollplex-trl] held-out accuracy after GRPO step {state.global_step}: "
                      f"{scores[-1].accuracy:.3f}")

    config = RollplexGRPOConfig(
        output_dir=str(out / "checkpoints"), max_steps=args.steps,
        per_device_train_batch_size=args.num_generations * args.prompts_per_step,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate, lr_scheduler_type="constant", beta=args.beta, logging_steps=1,
        save_steps=args.steps, save_strategy="steps", report_to=[], seed=args.seed, bf16=False,
        use_cpu=not torch.cuda.is_available(), gradient_checkpointing=False, dataloader_num_workers=0,
        rollplex_timeline=True, rollplex_temporal=args.temporal, rollplex_video_max_frames=args.frames,
        rollplex_video_max_pixels=args.max_pixels,
        rollplex_video_min_pixels=evaluate.sampling.min_pixels,
    )
    trainer = RollplexGRPOTrainer(model=str(start_model), reward_funcs=[accuracy_reward, format_reward],
                                  args=config, train_dataset=train,
                                  callbacks=[JsonlLoggerCallback(out / "logs.jsonl"), HeldoutEvery()])
    print(f"[rollplex-trl] GRPO: {args.steps} steps of RollplexGRPOTrainer, {args.prompts_per_step} prompts x "
          f"{args.num_generations} completions per step{', T-GRPO on' if args.temporal else ''}")
    trainer.train()
    return trainer, steps, scores


def format_table(table: dict[str, dict[str, float]], questions: int, samples: int) -> str:
    """The held-out accuracy table the main job prints."""
    lines = [f"[rollplex-trl] held-out accuracy ({questions} questions; sampled: {samples} answers each at "
             "temperature 1; greedy: one answer)",
             f"  {'model':<8} {'sampled':>8} {'greedy':>8} {'format':>8}"]
    lines += [f"  {name:<8} {row['sampled']:>8.3f} {row['greedy']:>8.3f} {row['format']:>8.3f}"
              for name, row in table.items()]
    return "\n".join(lines)


def plot_learning_curve(rewards: list[tuple[int, float]], heldout: list[tuple[int, float]], path: Path,
                        shuffled: list[tuple[int, float]] = ()) -> Path | None:
    """Training accuracy reward per GRPO step (and, with T-GRPO, that of the completions on shuffled clips) and
    held-out accuracy per evaluation, as a PNG (None when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axis = plt.subplots(figsize=(7, 3.5))
    if rewards:
        axis.plot(*zip(*rewards, strict=True), label="accuracy reward of the rollouts, per step", alpha=0.6)
    if shuffled:
        axis.plot(*zip(*shuffled, strict=True), label="the same on shuffled frames (T-GRPO)", alpha=0.6)
    if heldout:
        axis.plot(*zip(*heldout, strict=True), "o-", label="held-out accuracy (sampled)")
    axis.set_xlabel("GRPO step")
    axis.set_ylabel("accuracy")
    axis.set_ylim(0, 1.02)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m rollplex_trl.demo`` / ``examples/demo.py``: the same options as ``rollplex-trl demo``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return run_demo(add_demo_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

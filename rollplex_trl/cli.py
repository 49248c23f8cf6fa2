"""The `rollplex-trl` command.

- `rollplex-trl demo`: the main job (`rollplex_trl.demo`, also `examples/demo.py`, docs/main-job.md). Builds a
  local Qwen2.5-VL checkpoint and the synthetic left_right video task (real MP4 files, train and held-out), runs an
  SFT cold start and GRPO with `RollplexGRPOTrainer`, and prints the held-out accuracy of each stage.
- `rollplex-trl build-checkpoint`: writes a local checkpoint (tiny/demo/small; `--family qwen2.5-vl|qwen3-vl`, or
  the text model `--kind qwen2`).
- `rollplex-trl make-synthetic`: writes the synthetic video task in Video-R1 format.
- `rollplex-trl ask --checkpoint DIR --video FILE "question"`: a trained checkpoint's answer, frames sampled as in
  its training (recorded in the checkpoint's config).
- `rollplex-trl check-data --annotations FILE --model DIR`: every row through the training's data path; a report
  of bad rows and of frames, pixels and tokens per row.
- `rollplex-trl make-toy-data`: writes a toy text or image dataset (files `datasets.load_dataset` reads).
- `rollplex-trl grpo`: TRL's `trl grpo` with `RollplexGRPOTrainer` (`rollplex_trl.grpo_script`): the same arguments,
  `--config recipe.yaml` (examples/recipes/), every `rollplex_*` field; started through `accelerate launch`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from rollplex_trl.demo import add_demo_arguments

logger = logging.getLogger("rollplex_trl")


def _demo(args: argparse.Namespace) -> int:
    from rollplex_trl.demo import run_demo

    return run_demo(args)


def _build_checkpoint(args: argparse.Namespace) -> int:
    from rollplex_trl.testing.checkpoints import build_checkpoint

    path = build_checkpoint(args.output_dir, kind=args.family or args.kind, preset=args.preset, seed=args.seed)
    print(path)
    return 0


def _make_synthetic(args: argparse.Namespace) -> int:
    from rollplex_trl.data import SyntheticVideoConfig, write_synthetic_video_dataset

    path = write_synthetic_video_dataset(
        args.output_dir,
        SyntheticVideoConfig(num_samples=args.num_samples, seed=args.seed, num_frames=args.frames,
                             height=args.size, width=args.size, tasks=tuple(args.tasks.split(",")), split=args.split),
    )
    print(path)
    return 0


def _make_toy_data(args: argparse.Namespace) -> int:
    from rollplex_trl.data.toy import write_toy_dataset

    print(write_toy_dataset(args.output_dir, args.kind, size=args.num_samples, seed=args.seed))
    return 0


def _ask(args: argparse.Namespace) -> int:
    from rollplex_trl.inference import ask_checkpoint

    overrides = dict(fps=args.fps, min_frames=args.min_frames, max_frames=args.max_frames,
                     min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    answer, sampling, changed = ask_checkpoint(args.checkpoint, args.video, args.question,
                                               max_new_tokens=args.max_new_tokens, **overrides)
    if changed:
        logger.warning("frame sampling differs from the checkpoint's training: %s (the answer may differ from what "
                       "the model saw in training)", ", ".join(f"{k}={v}" for k, v in changed.items()))
    print(answer)
    return 0


def _check_data(args: argparse.Namespace) -> int:
    import json

    from rollplex_trl.data.check import check_data, format_report
    from rollplex_trl.data.video import VideoSamplingConfig

    sampling = VideoSamplingConfig(fps=args.fps, min_frames=args.min_frames, max_frames=args.max_frames,
                                   min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    report = check_data(args.annotations, args.model, data_root=args.data_root, sampling=sampling,
                        max_prompt_length=args.max_prompt_length, workers=args.workers, limit=args.limit,
                        progress=True)
    print(format_report(report))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report.to_json(), f, indent=2, default=str)
        print(f"report: {args.report}")
    return 1 if report.bad else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollplex-trl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="main job: SFT, then GRPO on the synthetic video task; held-out accuracy")
    add_demo_arguments(demo)
    demo.set_defaults(func=_demo)

    ckpt = sub.add_parser("build-checkpoint", help="write a local checkpoint")
    ckpt.add_argument("--output-dir", required=True)
    from rollplex_trl.models.families import FAMILIES

    kinds = ckpt.add_mutually_exclusive_group()
    kinds.add_argument("--family", choices=list(FAMILIES), help="a vision-language family (models/families.py)")
    kinds.add_argument("--kind", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen2", "qwen3_vl"],
                       help="a model type: a family's, or 'qwen2' (text)")
    ckpt.add_argument("--preset", default="tiny", choices=["tiny", "demo", "small", "3b"])
    ckpt.add_argument("--seed", type=int, default=0)
    ckpt.set_defaults(func=_build_checkpoint)

    syn = sub.add_parser("make-synthetic", help="write the synthetic video task (MP4 + Video-R1 JSONL)")
    syn.add_argument("--output-dir", required=True)
    syn.add_argument("--num-samples", type=int, default=64)
    syn.add_argument("--frames", type=int, default=16)
    syn.add_argument("--size", type=int, default=112)
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--tasks", default="count,direction,first_appeared",
                     help="task types, comma-separated, from count, direction, first_appeared, left_right")
    syn.add_argument("--split", default="train", choices=["train", "heldout"],
                     help="heldout: other random streams (left_right: disjoint scenes too)")
    syn.set_defaults(func=_make_synthetic)

    toy = sub.add_parser("make-toy-data", help="write a toy text or image dataset (for examples/recipes)")
    toy.add_argument("--output-dir", required=True)
    toy.add_argument("--kind", default="text", choices=["text", "image"])
    toy.add_argument("--num-samples", type=int, default=64)
    toy.add_argument("--seed", type=int, default=0)
    toy.set_defaults(func=_make_toy_data)

    ask = sub.add_parser("ask", help="ask a trained checkpoint about a video, frames sampled as in its training")
    ask.add_argument("--checkpoint", required=True, help="a checkpoint or final model folder the trainer saved")
    ask.add_argument("--video", required=True, help="the video file")
    ask.add_argument("question", help="the question (the video goes before it, as in training)")
    ask.add_argument("--max-new-tokens", type=int, default=128)
    for name, kind in (("fps", float), ("min-frames", int), ("max-frames", int), ("min-pixels", int),
                       ("max-pixels", int)):
        ask.add_argument(f"--{name}", type=kind, default=None,
                         help="override the checkpoint's recorded frame sampling (logged when it differs)")
    ask.set_defaults(func=_ask)

    from rollplex_trl.data.video import VideoSamplingConfig

    defaults = VideoSamplingConfig()
    check = sub.add_parser("check-data", help="every row of a Video-R1-format file through the training's data path",
                           description="Decode every row's media with the training's frame sampling and build its "
                           "prompt with the model's processor (as training does), in parallel; report bad rows, "
                           "frames/pixels/tokens per row and prompts over --max-prompt-length. Exit code 1 if a row "
                           "is bad.")
    check.add_argument("--annotations", required=True, help="Video-R1-format JSON / JSONL file")
    check.add_argument("--model", required=True, help="the checkpoint whose processor training uses")
    check.add_argument("--data-root", default=None, help="folder `./...` paths resolve against (default: the file's)")
    check.add_argument("--workers", type=int, default=1)
    check.add_argument("--limit", type=int, default=None, help="check the first N rows only")
    check.add_argument("--max-prompt-length", type=int, default=None, help="count prompts over this many tokens")
    check.add_argument("--report", default=None, help="write the per-row report as JSON here")
    check.add_argument("--fps", type=float, default=defaults.fps, help="as rollplex_video_fps")
    check.add_argument("--min-frames", type=int, default=defaults.min_frames, help="as rollplex_video_min_frames")
    check.add_argument("--max-frames", type=int, default=defaults.max_frames, help="as rollplex_video_max_frames")
    check.add_argument("--min-pixels", type=int, default=defaults.min_pixels, help="as rollplex_video_min_pixels")
    check.add_argument("--max-pixels", type=int, default=defaults.max_pixels, help="as rollplex_video_max_pixels")
    check.set_defaults(func=_check_data)

    # listed here for --help only: main() hands `grpo`'s arguments to the TRL parser untouched (see main)
    sub.add_parser("grpo", add_help=False,
                   help="TRL's `trl grpo` with RollplexGRPOTrainer (`rollplex-trl grpo --help` lists its options)")
    from rollplex_trl.memory.cli import register_cli as _memory
    _memory(sub)
    from rollplex_trl.sharding.cli import register_cli as _sharding
    _sharding(sub)
    from rollplex_trl.planning.cli import register_cli as _planning
    _planning(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["grpo"]:
        # `grpo` takes TRL's arguments, any `rollplex_*` field and `accelerate launch`'s flags: TrlParser sorts them,
        # not argparse's subcommand parser (which would reject the launcher's flags)
        from rollplex_trl.grpo_script import launch

        return launch(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

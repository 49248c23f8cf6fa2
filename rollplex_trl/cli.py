"""The `rollplex-trl` command.

- `rollplex-trl demo`: the main job (`rollplex_trl.demo`, also `examples/demo.py`). Builds a local Qwen2.5-VL
  checkpoint and the synthetic video task (real MP4 files), trains a few GRPO steps with `RollplexGRPOTrainer`, and
  says where the checkpoint and logs went.
- `rollplex-trl build-checkpoint`: writes a local checkpoint (tiny/small Qwen2.5-VL or Qwen2).
- `rollplex-trl make-synthetic`: writes the synthetic video task in Video-R1 format.
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
    add_demo_arguments(demo)
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

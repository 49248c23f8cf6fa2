"""The main job as a script: an SFT cold start, then GRPO, of a local Qwen2.5-VL on a synthetic video task.

The same job, with the same options, as `rollplex-trl demo` and `bash scripts/demo.sh` (they all call
`rollplex_trl.demo.run_demo`, docs/main-job.md). It builds a small Qwen2.5-VL locally (no model hub), writes real
MP4 clips of the left_right task in Video-R1 format (train and held-out), fine-tunes with TRL's SFTTrainer, trains
with `RollplexGRPOTrainer` and Video-R1's rewards, prints the held-out accuracy table and ends with

    [rollplex-trl] done. checkpoint: .../checkpoints/checkpoint-100 | logs: .../logs.jsonl | results: .../results.json

Run:
    .venv/bin/python examples/demo.py                          # about 2 minutes on 2 cores, into runs/demo
    .venv/bin/python examples/demo.py --sft-steps 20 --steps 2 --output-dir /tmp/demo
    .venv/bin/python examples/demo.py --help                   # every option
"""

import argparse
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every checkpoint is built locally
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rollplex_trl.demo import add_demo_arguments, run_demo  # noqa: E402


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_demo_arguments(parser)
    return run_demo(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())

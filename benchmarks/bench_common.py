"""What the benchmark scripts share: quiet output and the local checkpoint they measure on."""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path


def quiet_checkpoint(preset: str) -> Path:
    """Silence warnings, logging and progress bars (the printed table is the output) and return the local
    Qwen2.5-VL checkpoint of `preset`, built on first use (no model hub)."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    from rollplex_trl.testing.checkpoints import get_checkpoint

    hf_logging.disable_progress_bar()
    return get_checkpoint("qwen2_5_vl", preset)


def wall_step_clock():
    """A TrainerCallback recording each optimizer step's wall-clock seconds end to end: rollout, scoring, backward,
    the actor prefix's backward, clipping, the optimizer step, the weight sync and the callbacks (the time between
    consecutive `on_step_end` calls, the first from `on_train_begin`). TRL's `step_time` metric times only its
    `training_step` (not clipping, the optimizer step or the weight sync after it); this is what a user waits for."""
    import time

    from transformers import TrainerCallback

    class WallStepClock(TrainerCallback):
        def __init__(self):
            self.steps: list[float] = []
            self._last = None

        def on_train_begin(self, args, state, control, **kwargs):
            self._last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.steps.append(now - self._last)
            self._last = now

    return WallStepClock()


def add_image_workload_args(parser: argparse.ArgumentParser, *, repeats: int) -> None:
    """The image GRPO workload's options, shared by the benchmarks that run it (bench_vs_trl.py,
    bench_trl_defaults.py): model preset, G, forced completion length, image size, steps per run, runs."""
    parser.add_argument("--preset", default="small")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=repeats)

"""What the benchmark scripts share: quiet output, the local checkpoint they measure on, and the record of where a
result was measured (`run_meta`: commit, CPU, date, command; `benchmarks/report.py` prints it in docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shlex
import subprocess
import sys
import warnings
from datetime import UTC, datetime
from pathlib import Path

# environment variables that change what a benchmark measures: recorded in front of the command when set
COMMAND_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def quiet_checkpoint(preset: str, family: str = "qwen2.5-vl") -> Path:
    """Silence warnings, logging and progress bars (the printed table is the output) and return the local
    checkpoint of `family` (models/families.py) and `preset`, built on first use (no model hub)."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    from rollplex_trl.models.families import family_named
    from rollplex_trl.testing.checkpoints import get_checkpoint

    hf_logging.disable_progress_bar()
    return get_checkpoint(family_named(family).model_type, preset)


def add_family_arg(parser: argparse.ArgumentParser) -> None:
    """`--family`: the vision-language family the benchmark's local checkpoint is built as."""
    from rollplex_trl.models.families import FAMILIES

    parser.add_argument("--family", default="qwen2.5-vl", choices=list(FAMILIES),
                        help="model family of the local checkpoint (the same preset sizes)")


def synthetic_video_dataset(folder: Path, num_samples: int, frames: int, size: int):
    """The synthetic video task (real MP4s, Video-R1 format) as a training dataset: `num_samples` clips of `frames`
    frames of size x size pixels at 2 fps."""
    from rollplex_trl.data import SyntheticVideoConfig, load_video_r1, write_synthetic_video_dataset

    return load_video_r1(write_synthetic_video_dataset(folder, SyntheticVideoConfig(
        num_samples=num_samples, seed=0, num_frames=frames, height=size, width=size, fps=2)))


def write_video_result(out: str, args: argparse.Namespace, runs: dict, table: dict) -> Path:
    """Write a video-workload benchmark's JSON (meta: where and what was measured; its runs; its table)."""
    import json

    import torch

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {**run_meta(), "preset": args.preset, "G": args.generations, "C": args.completion_length,
            "prompts_per_step": args.prompts, "frames": args.frames, "size": args.size, "steps": args.steps,
            "repeats": args.repeats, "precision": "bf16 autocast" if args.bf16 else "fp32",
            "device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(),
            "torch": torch.__version__}
    path.write_text(json.dumps({"meta": meta, "runs": runs, "table": table}, indent=2))
    return path


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
    add_family_arg(parser)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=repeats)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _commit() -> str | None:
    """`git rev-parse --short HEAD`, with "-dirty" when tracked files differ from it; None outside a checkout."""
    head = _git("rev-parse", "--short", "HEAD")
    if not head or not head.strip():
        return None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return head.strip() + ("-dirty" if status and status.strip() else "")


def _cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), else `platform.processor()`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def _command() -> str:
    """The command line that ran this process, with the thread settings it ran under (`OMP_NUM_THREADS=2 python
    benchmarks/bench_x.py --steps 3`)."""
    env = [f"{name}={shlex.quote(os.environ[name])}" for name in COMMAND_ENV if name in os.environ]
    python = Path(sys.executable).name if sys.executable else "python"
    return " ".join([*env, python or "python", *(shlex.quote(arg) for arg in sys.argv)])


def run_meta() -> dict:
    """Where and how a result was measured, merged into every benchmark JSON's `meta`: the commit (None outside a
    git checkout; "-dirty" with uncommitted changes to tracked files), the CPU model, the number of CPUs, the UTC
    date and time the result was written, the command line and torch's version."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"commit": _commit(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"), "command": _command(),
            "torch": torch_version}

"""``TimelineImageCallback``: the phase timeline as an image in the run's trackers (TensorBoard, W&B, Trackio).

The ``rollplex/*`` numbers reach every tracker without help: they go through TRL's metrics, so transformers' own
tracker callbacks (``report_to=["tensorboard"]`` gives ``train/rollplex/decode_s`` ...) log them with the loss.
A picture does not: this callback renders the trainer's phase timeline (``trainer.timeline``, the same Gantt chart
``rollplex_timeline=True`` writes to ``output_dir/rollplex_timeline.png``) and hands it to each tracker in
``args.report_to`` that takes images, at the end of training and, with ``every_n_steps``, during it.

Use it either way:

    trainer = RollplexGRPOTrainer(..., callbacks=[TimelineImageCallback()])  # finds its trainer at train start
    trainer.add_callback(TimelineImageCallback(trainer, every_n_steps=50))

Only the main process logs (as transformers' tracker callbacks do). A tracker that fails to take the image logs a
warning; training never stops for a picture.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from rollplex_trl import trl_compat

logger = logging.getLogger(__name__)

IMAGE_TRACKERS = ("tensorboard", "wandb", "trackio")


def _report_to(args: Any) -> list[str]:
    value = getattr(args, "report_to", None) or []
    names = [value] if isinstance(value, str) else list(value)
    if "all" in names:
        return list(IMAGE_TRACKERS)
    return [n for n in names if n in IMAGE_TRACKERS]


def _read_png(path: Path):
    """(H, W, 3) uint8 array of an RGB(A) PNG."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


class TimelineImageCallback(TrainerCallback):
    """Log the phase timeline image to the image-taking trackers of ``args.report_to``.

    Args:
        trainer: the trainer whose ``timeline`` is drawn; ``None`` finds it when training starts.
        every_n_steps: also log every that many optimizer steps (``None``: at the end of training only).
        tag: the image's name in the trackers.
    """

    def __init__(self, trainer: Any = None, every_n_steps: int | None = None, tag: str = "rollplex/timeline") -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or None, got {every_n_steps}")
        self.trainer = trainer
        self.every_n_steps = every_n_steps
        self.tag = tag
        self.logged: list[tuple[str, int]] = []  # (tracker, step) of each image logged, for tests and curiosity

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            self.trainer = trl_compat.trainer_running_callback(self)  # given in callbacks=[...]
            if self.trainer is None:
                logger.warning("TimelineImageCallback: no trainer found; pass it as TimelineImageCallback(trainer)")

    def on_step_end(self, args, state, control, **kwargs):
        if self.every_n_steps and state.global_step % self.every_n_steps == 0:
            self.log_timeline(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        self.log_timeline(args, state)

    def log_timeline(self, args: Any, state: Any) -> None:
        """Render the timeline now and log it to each image tracker (main process only)."""
        trackers = _report_to(args)
        timeline = getattr(self.trainer, "timeline", None)
        if not trackers or not state.is_world_process_zero or timeline is None or not timeline.spans:
            return
        with tempfile.TemporaryDirectory(prefix="rollplex-timeline-") as tmp:
            png = timeline.write_gantt(Path(tmp) / "timeline.png", title=f"Rollplex phase timeline, step "
                                                                          f"{state.global_step}")
            if png is None:
                logger.warning("TimelineImageCallback: matplotlib is not installed; no timeline image")
                return
            for tracker in trackers:
                try:
                    if getattr(self, f"_log_{tracker}")(png, state.global_step):
                        self.logged.append((tracker, state.global_step))
                except Exception as error:  # a tracker's own failure must not stop training
                    logger.warning("TimelineImageCallback: %s did not take the timeline image: %s", tracker, error)

    def _tensorboard_callback(self):
        from transformers.integrations import TensorBoardCallback

        handler = getattr(self.trainer, "callback_handler", None)
        return next((cb for cb in getattr(handler, "callbacks", []) if isinstance(cb, TensorBoardCallback)), None)

    def _log_tensorboard(self, png: Path, step: int) -> bool:
        tb = self._tensorboard_callback()
        if tb is None:
            return False
        if tb.tb_writer is not None:  # during training: the run's own writer
            tb.tb_writer.add_image(self.tag, _read_png(png), step, dataformats="HWC")
            tb.tb_writer.flush()
            return True
        if tb.logging_dir is None:
            return False
        # At the end of training transformers' callback has already closed its writer (it runs before callbacks
        # added later): a second writer in the same folder adds an event file that TensorBoard reads as the same run.
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=tb.logging_dir)
        try:
            writer.add_image(self.tag, _read_png(png), step, dataformats="HWC")
        finally:
            writer.close()
        return True

    def _log_wandb(self, png: Path, step: int) -> bool:
        import wandb

        if wandb.run is None:
            return False
        wandb.run.log({self.tag: wandb.Image(str(png)), "train/global_step": step})  # WandbCallback's x axis
        return True

    def _log_trackio(self, png: Path, step: int) -> bool:
        import trackio

        if not hasattr(trackio, "Image"):
            return False
        trackio.log({self.tag: trackio.Image(str(png))})
        return True

"""What the benchmark scripts share: quiet output and the local checkpoint they measure on."""

from __future__ import annotations

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

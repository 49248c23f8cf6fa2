"""``JsonlLoggerCallback``: append every Trainer log record (loss, rewards, ``rollplex/*`` metrics) to a JSONL file.

One JSON object per line, ``{"step": global_step, **logs}``, written as each record is logged, so a run that stops
part-way still leaves the records of the steps it finished. The main job (``rollplex-trl demo``) writes
``logs.jsonl`` with it; any TRL script can pass it in ``callbacks=[...]``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import TrainerCallback


class JsonlLoggerCallback(TrainerCallback):
    """Append every log record to ``path`` (created with its folder; ``overwrite=True`` starts a fresh file).

    Only the main process writes (``state.is_world_process_zero``), as transformers' own loggers do.
    """

    def __init__(self, path: str | os.PathLike[str], overwrite: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if overwrite:
            self.path.unlink(missing_ok=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and state.is_world_process_zero:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": state.global_step, **logs}, default=_to_builtin) + "\n")


def _to_builtin(value):
    """numpy / torch scalars and other objects JSON does not know: their Python number, else their text."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)

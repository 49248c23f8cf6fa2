"""`CompactConsole`: one short line per logged training step instead of TRL's dictionary of ~50 keys.

    [rollplex-trl] step 3/8 · reward 0.250 (accuracy_reward 0.125, format_reward 0.000) · loss 0.0012 · kl 0.0031 ·
    2.41 s · audit ok

The full dictionaries still go to the trainer's log history, `logs.jsonl` (JsonlLoggerCallback) and the trackers.
`use_compact_console(trainer)` swaps it in for transformers' progress bar and printer.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import PrinterCallback, ProgressCallback, TrainerCallback


def format_step(logs: dict[str, Any], step: int, max_steps: int, seconds: float | None = None) -> str:
    """The compact line of one training log."""
    parts = [f"step {step}/{max_steps}"]
    if "reward" in logs:
        rewards = [(k[len("rewards/"):-len("/mean")], v) for k, v in logs.items()
                   if k.startswith("rewards/") and k.endswith("/mean")]
        detail = f" ({', '.join(f'{name} {value:.3f}' for name, value in rewards)})" if rewards else ""
        parts.append(f"reward {logs['reward']:.3f}{detail}")
    if "loss" in logs:
        parts.append(f"loss {logs['loss']:.4g}")
    if "kl" in logs:
        parts.append(f"kl {logs['kl']:.4g}")
    if seconds is not None:
        parts.append(f"{seconds:.2f} s")
    if "rollplex/verify_within_tolerance" in logs:  # an audited step: the audit's verdict (1 = every check held)
        ok = logs["rollplex/verify_within_tolerance"] >= 1.0
        worst = max((v for k, v in logs.items() if k.startswith("rollplex/verify_") and k.endswith("logp_abs")),
                    default=0.0)
        parts.append(f"audit {'ok' if ok else 'EXCEEDED'} (max |Δ log-prob| {worst:.1e})")
    return "[rollplex-trl] " + " · ".join(parts)


class CompactConsole(TrainerCallback):
    def __init__(self) -> None:
        self._last: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.perf_counter()

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        if "train_runtime" in logs:  # the end of training: one line, also when no step was logged (logging_steps)
            print(f"[rollplex-trl] trained {state.global_step} steps in {logs['train_runtime']:.1f} s", flush=True)
            return
        if "loss" not in logs:
            return  # training steps only (evaluation stays in the log history)
        now = time.perf_counter()
        seconds = now - self._last if self._last is not None else None
        self._last = now
        print(format_step(logs, state.global_step, state.max_steps, seconds), flush=True)


def use_compact_console(trainer: Any) -> None:
    """Replace transformers' progress bar and dictionary printer with `CompactConsole` (once: a second call on the
    same trainer changes nothing). `RollplexGRPOTrainer` does this itself under `rollplex_console="compact"`; the
    function serves other trainers (the main job's `SFTTrainer`)."""
    for callback in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(callback)
    if not any(isinstance(c, CompactConsole) for c in trainer.callback_handler.callbacks):
        trainer.add_callback(CompactConsole())

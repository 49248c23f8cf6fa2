"""`NoLearningSignal`: a warning, once per run, when GRPO has nothing to learn from for several steps in a row.

GRPO's advantage is each completion's reward minus its group's mean: when every group of a step has zero reward
spread (TRL's `frac_reward_zero_std` is 1), the loss and the gradient are zero and the step changes nothing (with
beta = 0). A few such steps happen; many in a row mean the run is not learning, and the usual causes can be read off
the same logs: no reward ever fires, completions are cut at `max_completion_length` before the answer, or the
answer format is never matched.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class NoLearningSignal(TrainerCallback):
    def __init__(self, steps: int = 3) -> None:
        self.steps = steps  # consecutive logged steps with zero reward spread in every group before warning
        self.streak = 0
        self.warned = False

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        if not logs or "frac_reward_zero_std" not in logs:
            return
        self.streak = self.streak + 1 if logs["frac_reward_zero_std"] >= 1.0 else 0
        if self.streak >= self.steps and not self.warned and state.is_world_process_zero:
            self.warned = True
            logger.warning(self.message(logs))

    def message(self, logs: dict[str, Any]) -> str:
        causes = []
        rewards = {k[len("rewards/"):-len("/mean")]: v for k, v in logs.items()
                   if k.startswith("rewards/") and k.endswith("/mean")}
        silent = [name for name, value in rewards.items() if value == 0]
        if silent:
            causes.append(f"reward functions that returned 0 for every completion: {', '.join(silent)}")
        clipped = logs.get("completions/clipped_ratio")
        if clipped is not None and clipped >= 0.5:
            causes.append(f"{clipped:.0%} of the completions were cut at max_completion_length (raise it, or reward "
                          "shorter answers)")
        if any("format" in name for name in silent):
            causes.append("the answer format (e.g. <think>...</think><answer>...</answer>) is never produced: a "
                          "supervised cold start or a format reward with partial credit gives the model a start")
        if not causes:
            causes.append("every completion of each group got the same reward (a reward that is too coarse, or a "
                          "policy that has collapsed)")
        return (f"rollplex: no learning signal for {self.streak} logged steps in a row: every group had zero reward "
                f"spread (frac_reward_zero_std = 1), so the advantages, the loss and the gradient are zero. Likely: "
                + "; ".join(causes) + ".")

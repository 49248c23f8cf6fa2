"""The reward bonuses of Video-R1's recipe, per group of completions of one prompt.

Video-R1 (`src/r1-v/src/open_r1/trainer/grpo_trainer.py`, `temporal=True`, `len_control=True`) computes, over a
device batch that holds one prompt:

- T-GRPO: p = mean accuracy reward of the ordered completions, p̃ = that of the completions sampled on the shuffled
  frames. If p ≥ μ·p̃, each ordered completion whose accuracy reward is > 0.1 gets α added to its accuracy reward.
- Length control: if more than one completion has accuracy reward > 0.1, each of those whose completion length
  (tokens, the completion mask's sum) lies in [320, 512] gets 0.2 added to its reward. Video-R1 tests correctness
  on the accuracy reward *before* the temporal bonus.

Here both are computed per group (one prompt's completions), which is Video-R1's computation when a device batch
holds one prompt (its `per_device_train_batch_size 1`). The accuracy reward is one column of TRL's
`rewards_per_func`; the bonuses are returned, not applied, so the trainer decides where they go and what is logged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TemporalBonus:
    """T-GRPO's constants (Video-R1's: α = 0.3, μ = 0.8, correct when accuracy > 0.1)."""

    alpha: float = 0.3
    mu: float = 0.8
    correct_above: float = 0.1


@dataclass(frozen=True)
class LengthControl:
    """Length control's constants (Video-R1's: +0.2 for a correct completion of 320 to 512 tokens, inclusive, when
    more than one completion of the group is correct)."""

    low: int = 320
    high: int = 512
    bonus: float = 0.2
    correct_above: float = 0.1


def temporal_bonus(accuracy: torch.Tensor, shuffled_accuracy: torch.Tensor, has_shuffled: torch.Tensor,
                   spec: TemporalBonus = TemporalBonus()) -> tuple[torch.Tensor, torch.Tensor]:
    """The temporal bonus of each ordered completion, and whether it fired per group.

    `accuracy`: (B, G) accuracy rewards of the ordered completions, one row per group (prompt). `shuffled_accuracy`:
    (B, S) those of the completions sampled on the shuffled frames (any values where `has_shuffled` is False).
    `has_shuffled`: (B,) bool, the groups that have a shuffled copy (video prompts with two or more temporal
    patches); the others get no bonus. NaN rewards (a reward function that does not apply, as TRL allows) count as
    not correct and are left out of the means. Returns ((B, G) bonus, (B,) fired).
    """
    ordered_mean = torch.nanmean(accuracy.float(), dim=1)
    shuffled_mean = torch.nanmean(shuffled_accuracy.float(), dim=1) if shuffled_accuracy.size(1) else ordered_mean
    # nanmean of an all-NaN group is NaN: the comparison is then False (no bonus), which is what "no accuracy" means
    fired = has_shuffled & (ordered_mean >= spec.mu * shuffled_mean)
    correct = torch.nan_to_num(accuracy.float(), nan=0.0) > spec.correct_above
    bonus = torch.where(correct & fired.unsqueeze(1), spec.alpha, 0.0)
    return bonus.to(accuracy.dtype), fired


def length_bonus(accuracy: torch.Tensor, lengths: torch.Tensor, spec: LengthControl = LengthControl()
                 ) -> torch.Tensor:
    """Length control's bonus of each completion: (B, G) from (B, G) accuracy rewards (before any temporal bonus)
    and (B, G) completion lengths in tokens."""
    correct = torch.nan_to_num(accuracy.float(), nan=0.0) > spec.correct_above
    several = correct.sum(dim=1, keepdim=True) > 1
    in_range = (lengths >= spec.low) & (lengths <= spec.high)
    return torch.where(correct & several & in_range, spec.bonus, 0.0).to(accuracy.dtype)

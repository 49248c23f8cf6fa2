"""Reward functions checked at the boundary: a non-finite reward is a bug in the reward, never a silent zero."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from rollplex_trl.data.errors import RollplexDataError
from rollplex_trl.trl_compat import is_async_callable


def reject_non_finite_rewards(func: Callable, name: str) -> Callable:
    """Make a synchronous reward function fail loudly when it returns NaN or an infinity, of any numeric type.

    TRL reads `None` as "this reward does not apply to this sample" and turns it into NaN, which later sums as 0. A
    NaN coming back from the function itself is a bug in the reward, and would be treated the same way: silently;
    an infinity would swamp the group's advantages. Python, NumPy and 0-d/1-element torch numbers are all checked.
    Models (nn.Module) and async functions are returned unchanged.
    """
    if isinstance(func, torch.nn.Module) or not callable(func) or is_async_callable(func):
        return func

    @functools.wraps(func)
    def checked(*args: Any, **kwargs: Any):
        rewards = func(*args, **kwargs)
        for i, r in enumerate(rewards):
            value = _reward_value(r)
            if value is not None and not math.isfinite(value):
                ids = kwargs.get("problem_id")
                sample = f"problem_id={ids[i]}" if isinstance(ids, list) and i < len(ids) else f"row {i}"
                raise RollplexDataError(
                    f"reward function '{name}' returned {'NaN' if math.isnan(value) else value} ({type(r).__name__}) "
                    f"for {sample} of the batch. "
                    "Return None for samples the reward does not apply to, or fix the reward."
                )
        return rewards

    return checked


def _reward_value(r: Any) -> float | None:
    """A reward as a float, or None where it is not a single number (None, or a type TRL itself will refuse)."""
    if r is None or isinstance(r, bool):
        return None
    if isinstance(r, torch.Tensor):
        return float(r) if r.numel() == 1 else None
    if isinstance(r, numbers.Real) or (hasattr(r, "dtype") and getattr(r, "shape", None) == ()):  # NumPy scalars
        try:
            return float(r)
        except (TypeError, ValueError):
            return None
    return None

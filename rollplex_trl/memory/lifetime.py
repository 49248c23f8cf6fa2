"""Lifetime classes, phases of one GRPO step, and the placement rule that joins them.

Rollplex's rule: an object occupies accelerator memory only between its first latency-critical use and its last use.
Every large object is therefore declared with a lifetime class and a window ``[first_use, last_use]`` of phases; the
class says what happens to it *outside* its window:

- boundary: reference and actor prefix state. Resident in its window; per-step data, so freed after its last use.
- permanent: fp32 master weights and optimizer moments. Their home is the host; they visit the device only in the
  optimizer phase, and then only chunk by chunk (see ``StreamedOptimizer``).
- regenerable: bf16 weight snapshots (rollout copy, reference model). Dropped when a ``regenerate`` function can
  rebuild them (from the master or a host copy), otherwise parked on the host.
- phase-local: rollout KV cache, scoring temporaries, non-critical activations. Freed (or recomputed) after use.
"""

from __future__ import annotations

from enum import StrEnum


class LifetimeClass(StrEnum):
    BOUNDARY = "boundary"
    PERMANENT = "permanent"
    REGENERABLE = "regenerable"
    PHASE_LOCAL = "phase_local"


class Phase(StrEnum):
    """Phases of one optimizer step, in step order (``STEP_ORDER``); ``IDLE`` is the gap between two steps."""

    ROLLOUT = "rollout"  # decode window; Rollplex runs the ViT and the ref/actor prefix inside it
    SCORE = "score"  # old/ref log-probs (suffix passes without grad), rewards, advantages
    TRAIN = "train"  # loss forward/backward: suffix, then the prefix backward through the boundary
    OPTIMIZER = "optimizer"  # the optimizer step (streamed chunks)
    SYNC = "sync"  # publish theta_{k+1} to the rollout engine (rebuild the layout-incompatible tensors)
    IDLE = "idle"


class Placement(StrEnum):
    DEVICE = "device"
    HOST = "host"
    FREED = "freed"


# Cyclic: a window may wrap around the step boundary (e.g. a rollout-layout buffer rebuilt in SYNC and read in the
# next ROLLOUT lives in [SYNC, ROLLOUT], which includes IDLE).
STEP_ORDER: tuple[Phase, ...] = (Phase.ROLLOUT, Phase.SCORE, Phase.TRAIN, Phase.OPTIMIZER, Phase.SYNC, Phase.IDLE)


def as_phase(phase: Phase | str) -> Phase:
    try:
        return Phase(phase)
    except ValueError:
        names = ", ".join(p.value for p in Phase)
        raise ValueError(f"unknown phase {phase!r}; known phases: {names}") from None


def window(first_use: Phase | str, last_use: Phase | str) -> tuple[Phase, ...]:
    """The phases from ``first_use`` to ``last_use`` inclusive, in step order, wrapping around the step boundary."""
    start, end = STEP_ORDER.index(as_phase(first_use)), STEP_ORDER.index(as_phase(last_use))
    if start <= end:
        return STEP_ORDER[start : end + 1]
    return STEP_ORDER[start:] + STEP_ORDER[: end + 1]


def outside_window_placement(lifetime: LifetimeClass, can_regenerate: bool) -> Placement:
    """Where an object of this class goes when the current phase is outside its window."""
    if lifetime is LifetimeClass.PERMANENT:
        return Placement.HOST
    if lifetime is LifetimeClass.REGENERABLE:
        # Rebuilding is cheaper than a host copy round trip when the source (master weights, a host snapshot)
        # exists anyway; without a regenerate function the only safe choice is to keep the bytes on the host.
        return Placement.FREED if can_regenerate else Placement.HOST
    return Placement.FREED

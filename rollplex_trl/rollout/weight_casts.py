"""Autocast's casts of frozen weights, kept across the decode steps of a rollout.

Under TRL's `bf16=True` the rollout decodes in autocast, over fp32 weights (TRL loads models in fp32). Torch's
autocast keeps its cast of a weight, for the rest of the outermost autocast region, only if the weight is a leaf
that requires grad; a frozen weight is cast again at every use, i.e. at every decode step: the weights read and
written once more per generated token (measured on CPU: decode steps of weight-bound layers 3x slower). The trainer
opens one autocast region around all decode steps of a `generate` call (prefix/generation.py), so trainable weights
are cast once per call; frozen ones (PEFT's base weights, a frozen vision tower or LLM, the Megatron backend's
rollout model) are not, unless they are marked as requiring grad while decoding, which is what this does.

Safe only where nothing differentiates through the model during the block: the decode runs under no_grad, and the
caller makes sure no graph-building job runs on the same model concurrently (the overlap's actor job).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def frozen_weight_casts_kept(model: nn.Module) -> Iterator[None]:
    """Within the block, `model`'s frozen float weights count as requiring grad, so autocast casts each once per
    autocast region (the same values it casts at every call otherwise); their flags are restored at the end."""
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)

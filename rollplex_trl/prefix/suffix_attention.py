"""Cascade attention in the scoring passes: each completion attends to its prompt's K/V without a per-row copy.

`suffix_logps` runs R = U*G rows of [last prompt token, completion] against the U prompts' K/V. With the default
("concat") cache layer, every decoder layer gathers the prompt's K/V to the R rows and concatenates each row's own,
then runs the model's attention with a (R, 1+C, P+C) mask. That costs, per layer, a G-fold copy of the prompt's K/V
(forward, and its gradient scattered back), and, because a mask is given, the masked upper half of the completion's
own attention is computed and thrown away. At a long completion (C >> P: text reasoning) the latter dominates: the
shared path was 0.79x of the unshared one in the reference pass at ~10% prompt share.

"cascade" instead: the cache layer serves only the row's own K/V (tagged with the layer), and the attention
function, switched to a registered wrapper of the model's own for the call, recognizes the tag and runs
`cascade.causal_cascade_attention`: the prompt part as one fused product per prompt for its G rows (read once, its
gradient summed over the rows in the same product), the completion part as a causal fused kernel per row (the upper
half skipped), merged exactly by log-sum-exp; the backward is the fused kernels' own, given the merged statistics.
Untagged calls (any other forward of the same model, e.g. the overlap's prefix jobs in another thread) go to the
original function unchanged.

Under gradient checkpointing the backward recomputes each decoder layer later, outside the suffix call; the switch
is re-entered for that recompute (`trl_compat.checkpointed_forwards_within`), so the recompute is the same cascade
computation and not the original attention on the suffix's keys alone.

Applies on CPU (PyTorch's fused CPU flash kernels return the log-sum-exp the merge needs) with the sdpa or eager
implementation, full-attention layers and no attention dropout; the run plan (trainers/plan.py) says which
path a model gets.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from rollplex_trl import trl_compat
from rollplex_trl.prefix.cascade import RowGroups, causal_cascade_attention
from rollplex_trl.prefix.shared_decode import base_attention

logger = logging.getLogger(__name__)

MODES = ("auto", "cascade", "concat")
SUPPORTED_ATTENTION = ("sdpa", "eager")
_NAME = "rollplex_suffix_{}"  # the registered wrapper of each base implementation
# id of the key tensor a CascadeSuffixLayer returned from `update` -> (a weak reference to it, that layer): HF passes
# the very tensor on to the attention function, which finds its prompt's K/V here. The entry leaves with its tensor
# (the weak reference's callback), and a lookup checks identity, so a reused id never matches.
_SERVED: dict[int, tuple[weakref.ref, CascadeSuffixLayer]] = {}


def _serve(key_states: torch.Tensor, layer: CascadeSuffixLayer) -> None:
    ident = id(key_states)
    _SERVED[ident] = (weakref.ref(key_states, lambda _: _SERVED.pop(ident, None)), layer)


def _served_by(key: torch.Tensor) -> CascadeSuffixLayer | None:
    entry = _SERVED.get(id(key))
    return entry[1] if entry is not None and entry[0]() is key else None


class CascadeSuffixLayer(trl_compat.DynamicLayer):
    """A decoder layer's cache in a cascade suffix pass: serves the row's own K/V only, tagged with this layer, whose
    prompt K/V (U, Hkv, P-1, D), prompt padding mask (U, P-1) and row grouping the attention wrapper reads.

    Stores nothing: the first run and a checkpoint's recompute see the same prompt states (as `_ReadOnlyLayer`)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, prefix_mask: torch.Tensor, groups: RowGroups):
        super().__init__()
        self.keys, self.values, self.prefix_mask, self.groups = keys, values, prefix_mask, groups
        self.device, self.is_initialized = keys.device, True
        self.served = False  # set by the first update: a forward that never asked would have ignored the prompt

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.served = True
        _serve(key_states, self)
        return key_states, value_states


def _make_attention(base: str):
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
        layer = _served_by(key)
        if layer is None:
            return base_attention(base, module)(module, query, key, value, attention_mask, dropout=dropout,
                                                 scaling=scaling, **kwargs)
        if dropout:
            raise RuntimeError("cascade suffix attention with attention dropout (the run plan excludes it)")
        scale = scaling if scaling is not None else query.size(-1) ** -0.5
        dtype = query.dtype  # autocast: the projections' dtype; the prompt's K/V follow it (a differentiable cast)
        out = causal_cascade_attention(query, layer.keys.to(dtype), layer.values.to(dtype), layer.prefix_mask,
                                       layer.groups, key.to(dtype), value.to(dtype), scale)
        return out.transpose(1, 2).contiguous(), None

    return attention


def _register() -> None:
    """Register the wrappers (idempotent), each with its base's mask function, so HF builds the mask it would."""
    for base in ("sdpa", "eager"):
        trl_compat.register_attention(_NAME.format(base), _make_attention(base), mask_like=base)


def unsupported_reason(causal_lm: nn.Module, device: torch.device) -> str | None:
    """Why the cascade suffix cannot run this model exactly, or None if it can."""
    text_config = causal_lm.config.get_text_config()
    implementation = trl_compat.attention_implementation(causal_lm)
    if device.type != "cpu":
        return f"device {device.type}: the fused kernels with log-sum-exp are wired for CPU only (not run on a GPU)"
    if implementation not in SUPPORTED_ATTENTION:
        return f"attention implementation {implementation!r} (supported: {', '.join(SUPPORTED_ATTENTION)})"
    if any(t != "full_attention" for t in getattr(text_config, "layer_types", None) or []):
        return "sliding-window decoder layers"
    if causal_lm.training and getattr(text_config, "attention_dropout", 0.0):
        return "attention dropout in training mode"
    return None


@contextlib.contextmanager
def cascade_attention_switched(causal_lm: nn.Module) -> Iterator[None]:
    """Within the block, the text config's attention implementation is the cascade wrapper of its own."""
    _register()
    base = trl_compat.attention_implementation(causal_lm)
    if base.startswith(_NAME.format("")):  # already switched (a checkpoint recompute inside the forward's block)
        yield
        return
    with trl_compat.attention_implementation_set(causal_lm, _NAME.format(base)):
        yield

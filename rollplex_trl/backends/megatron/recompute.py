"""Activation recompute for the Megatron policy's LLM: TRL's ``gradient_checkpointing`` on this backend.

With ``gradient_checkpointing=True`` (TRL's default) the hf backend keeps only each decoder layer's input and
recomputes the layer in the backward; here every megatron-core ``TransformerLayer`` of the policy does the same
(Megatron's "full / uniform / 1 layer" recompute), so the two backends hold the same activations.

Why not megatron-core's own recompute (``TransformerConfig.recompute_granularity="full"``): its
``tensor_parallel.checkpoint`` is a reentrant ``autograd.Function`` that backpropagates only into the block's
positional tensor arguments. In a shared-prefix suffix pass the layers also read the prompt's cached K/V (through
the core attention's hook, not an argument), so the gradient into the prompt's K/V (and from there into the prompt,
the merger and the vision tower) would be silently dropped; it also saves and restores CUDA RNG states, which a CPU
run does not have. torch's non-reentrant checkpoint records the graph of everything the layer touches, so the cached
K/V get their gradient, and it restores autocast and the CPU RNG for the recompute itself.

The recompute runs in the backward, after the prefix/suffix pass that set the core attention's K/V hook has ended;
each checkpointed layer therefore re-installs, for its recompute, the hook that was active in its first run, with
the passes' own ``_hooked`` (which refuses to overwrite the hook of a pass still running). The hooks are
replay-safe: ``_Capture`` records only on its first call, ``_Serve`` stores nothing. Only training-mode forwards
with autograd on are checkpointed: the reference and old-policy passes (no_grad) and eval forwards run as before.
Exact: the recompute repeats the same kernels on the same inputs (tests/megatron/test_recompute.py compares
log-probs and gradients with it on and off bit for bit, fp32 and bf16 autocast).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rollplex_trl.backends.megatron.prefix import PrefixCoreAttention, _hooked


def _checkpointed(layer: nn.Module, forward: Callable[..., Any], core_attention: nn.Module) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not (layer.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        hook = vars(core_attention).get("prefix_hook")  # the pass's K/V hook (None outside a prefix/suffix pass)

        def replayable(*inner_args: Any, **inner_kwargs: Any) -> Any:
            if hook is None or vars(core_attention).get("prefix_hook") is hook:
                return forward(*inner_args, **inner_kwargs)  # the first run, inside its pass
            with _hooked([core_attention], hook):  # the recompute, after the pass ended: its hook back
                return forward(*inner_args, **inner_kwargs)

        return checkpoint(replayable, *args, use_reentrant=False, **kwargs)

    return run


def enable_layer_recompute(gpt: nn.Module) -> int:
    """Checkpoint every decoder layer of megatron-core's ``GPTModel`` ``gpt`` in training forwards (the layer's
    instance ``forward`` wrapped; idempotent). Returns the number of layers that recompute."""
    layers = list(gpt.decoder.layers)
    for layer in layers:
        if getattr(layer, "rollplex_recompute", False):
            continue
        cores = [m for m in layer.modules() if isinstance(m, PrefixCoreAttention)]
        if len(cores) != 1:
            raise RuntimeError(f"decoder layer {getattr(layer, 'layer_number', '?')} has {len(cores)} "
                               "PrefixCoreAttention modules (expected 1: built without the prefix layer spec?)")
        layer.forward = _checkpointed(layer, layer.forward, cores[0])
        layer.rollplex_recompute = True
    return len(layers)


def disable_layer_recompute(gpt: nn.Module) -> None:
    """Undo :func:`enable_layer_recompute` (the class's forward again)."""
    for layer in gpt.decoder.layers:
        if vars(layer).pop("rollplex_recompute", False):
            del layer.forward

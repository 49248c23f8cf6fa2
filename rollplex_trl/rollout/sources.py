"""The trainer's tensors under the names vLLM loads (HF checkpoint names), PEFT-aware.

PEFT: vLLM needs the merged weight W + s·B·A of every LoRA layer. TRL merges the adapter into the trainer's base
weights (`merge_adapter()`), reads them, and unmerges (`W -= s·B·A`): the base weights drift by a rounding error at
every sync, and bf16 bases drift visibly over a run. Here the base weight is never written: a source carries the
base tensor and a `delta()` that returns s·B·A, and the sync adds the delta into vLLM's copy. The trainer's weights
stay bit-identical, merged or not.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# Models whose tensors are bound to another engine's training parameters (the Megatron backend's rollout model): what
# they are bound to, for messages. Kept here rather than as an attribute on the user's model.
_BOUND: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def bind_weights(model: torch.nn.Module, to: str) -> None:
    """Record that `model`'s tensors are views of `to`'s training parameters: they change at every optimizer step
    although none requires grad, and must not be moved (e.g. into vLLM's storage)."""
    _BOUND[model] = to


def weights_bound_to(model: torch.nn.Module) -> str | None:
    return _BOUND.get(model)


@dataclass
class TrainerTensor:
    """One of the trainer's tensors under the HF checkpoint name vLLM loads it by."""

    name: str  # HF checkpoint name, e.g. "model.layers.0.self_attn.q_proj.weight"
    param: torch.nn.Parameter  # the trainer's tensor (the frozen base weight for a LoRA layer)
    delta: Callable[[], torch.Tensor] | None = None  # LoRA: the merged-in update, same shape as `param`
    trainable: bool = True  # whether its value can change between syncs (trainable, or with a LoRA delta)

    @property
    def tensor(self) -> torch.Tensor:
        return self.param.detach()


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def _lora_delta(module: torch.nn.Module) -> Callable[[], torch.Tensor] | None:
    """s·B·A summed over the active adapters of a PEFT LoRA layer, or None when nothing is to be added."""
    if getattr(module, "merged", False):  # the user merged the adapter into the base: the base already has it
        return None
    adapters = [a for a in getattr(module, "active_adapters", []) if a in getattr(module, "lora_A", {})]
    if not adapters or getattr(module, "disable_adapters", False):
        return None

    def delta() -> torch.Tensor:
        with torch.no_grad():
            total = module.get_delta_weight(adapters[0])
            for name in adapters[1:]:
                total = total + module.get_delta_weight(name)
            return total

    return delta


def iter_sources(model: torch.nn.Module) -> Iterator[TrainerTensor]:
    """The tensors vLLM needs, under HF names, with LoRA deltas for PEFT models.

    Non-PEFT: `named_parameters()` (tied weights once, as vLLM expects), names with TRL's wrapper prefixes removed.
    PEFT: base-layer weights under the base model's names, LoRA factors skipped, `modules_to_save` copies used in
    place of the originals.
    """
    if not _is_peft(model):
        # a model bound to another engine's training parameters (the Megatron backend's rollout model) changes at
        # every optimizer step although none of its parameters requires grad
        bound = weights_bound_to(model) is not None
        for name, param in model.named_parameters():
            yield TrainerTensor(_clean(name), param, trainable=param.requires_grad or bound)
        return
    prefix = getattr(model, "prefix", "lora_")
    deltas: dict[str, Callable[[], torch.Tensor] | None] = {}
    for mod_name, module in model.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
            deltas[mod_name] = _lora_delta(module)
    for name, param in model.named_parameters():
        if prefix in name or "original_module" in name:
            continue
        owner = name.rsplit(".", 1)[0]
        delta = None
        if owner.endswith(".base_layer") and name.endswith(".weight"):
            delta = deltas.get(owner.removesuffix(".base_layer"))
        clean = _clean(name.removeprefix("base_model.model.").replace(".base_layer", "")
                       .replace("modules_to_save.default.", ""))
        yield TrainerTensor(clean, param, delta=delta, trainable=param.requires_grad or delta is not None)


def _clean(name: str) -> str:
    # Wrappers that insert a module level (activation checkpointing, torch.compile) are invisible to vLLM.
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name

"""The vLLM side of the weight sync: targets (layout + pieces) of a live vLLM model, and its repacking hook.

Names: vLLM models declare how HF names map to theirs (`hf_to_vllm_mapper`, with `orig_to_new_stacked` for the
fused layers, e.g. ".q_proj" -> (".qkv_proj", "q")); models without a mapper fall back to
`packed_modules_mapping` ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}) with vLLM's usual shard ids.

Repacking: vLLM's CPU backend runs `dispatch_cpu_unquantized_gemm` on every linear layer after loading (the
layer's `quant_method.process_weights_after_loading`): the weight becomes a oneDNN/SGL handle and `layer.weight`
an empty tensor (`remove_weight=True`), except for embeddings/LM heads, which keep their weight. Such layers carry a
`cpu_linear` attribute. The sync stages their new weight and calls the same post-load processing again.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rollplex_trl.rollout.layout import Target, describe_pieces
from rollplex_trl.rollout.sources import Source

# vLLM's shard ids for the fused layers of packed_modules_mapping (used when a model has no mapper).
_DEFAULT_SHARD_IDS = {"qkv_proj": ["q", "k", "v"]}


def _mapper(model: torch.nn.Module):
    return getattr(model, "hf_to_vllm_mapper", None)


def map_name(model: torch.nn.Module, hf_name: str) -> tuple[str, str | int | None] | None:
    """(vLLM parameter name, shard id or None) for an HF tensor name, or None when vLLM does not load it."""
    mapper = _mapper(model)
    if mapper is not None and hasattr(mapper, "_map_name_with_shard"):
        mapped = mapper._map_name_with_shard(hf_name)
        if mapped is None:
            return None
        name, shard = mapped
        if isinstance(shard, list):  # one HF tensor loaded into several shards: not a Qwen/Llama layout
            raise ValueError(f"{hf_name} maps to several shards {shard} of {name}; not supported")
        if shard is not None or not hasattr(model, "packed_modules_mapping"):
            return name, shard
        hf_name = name
    for fused, parts in getattr(model, "packed_modules_mapping", {}).items():
        for i, part in enumerate(parts):
            token = f".{part}."
            if token in hf_name:
                ids = _DEFAULT_SHARD_IDS.get(fused)
                return hf_name.replace(token, f".{fused}.", 1), (ids[i] if ids else i)
    return hf_name, None


def is_repacked(module: torch.nn.Module) -> bool:
    return hasattr(module, "cpu_linear")


class VLLMTargets:
    """Targets of a live vLLM model (one rank's shard), for `WeightSync`."""

    def __init__(self, model: torch.nn.Module, sources: Iterable[Source]):
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.targets: dict[str, Target] = {}
        self.skipped: list[str] = []
        for src in sources:
            mapped = map_name(model, src.name)
            if mapped is None or mapped[0] not in self.params:
                if mapped is not None and self._tied_lm_head(mapped[0]):
                    continue  # vLLM ties lm_head to the embedding: the embedding's sync covers it
                self.skipped.append(src.name)
                continue
            name, shard = mapped
            module_name, attr = name.rsplit(".", 1)
            module = model.get_submodule(module_name)
            target = self.targets.get(name) or self._new_target(name, module_name, attr, module)
            self.targets[name] = target
            target.pieces += describe_pieces(module, src.name, tuple(src.tensor.shape), name, attr, shard)

    def _tied_lm_head(self, name: str) -> bool:
        return name.startswith("lm_head") and getattr(getattr(self.model, "config", None), "tie_word_embeddings",
                                                      False)

    def _new_target(self, name: str, module_name: str, attr: str, module: torch.nn.Module) -> Target:
        param = self.params[name]
        repacked = attr == "weight" and is_repacked(module)
        keeps = repacked and param.numel() > 0
        if repacked and not keeps:
            # the unpacked shape is gone with the tensor; the layer still knows its partition sizes
            shape = (module.output_size_per_partition, module.input_size_per_partition)
        else:
            shape = tuple(param.shape)
        return Target(name=name, module_name=module_name, attr=attr, shape=shape, dtype=param.dtype,
                      repacked=repacked, keeps_weight=keeps)

    def live(self, name: str) -> torch.Tensor | None:
        t = self.targets[name]
        if t.repacked and not t.keeps_weight:
            return None
        # vLLM may have replaced the Parameter object (repacking does); look it up on the module each time
        return getattr(self.model.get_submodule(t.module_name), t.attr).data

    def reprocess(self, module_name: str, staged_weight: torch.Tensor | None) -> None:
        module = self.model.get_submodule(module_name)
        if staged_weight is not None:
            # the layer's post-load processing reads `layer.weight`; it drops this reference when it repacks
            module.weight = torch.nn.Parameter(staged_weight, requires_grad=False)
        module.quant_method.process_weights_after_loading(module)

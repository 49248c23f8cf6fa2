"""The vLLM side of the weight sync: targets (layout + pieces) of a live vLLM model, and its repacking hook.

Layout: every target comes from `rollplex_trl.sharding`'s declarative table, the one place that knows how vLLM packs
HF tensors (`q/k/v_proj` -> rows of `qkv_proj` with KV heads replicated when the rank count exceeds them,
`gate/up_proj` -> `gate_up_proj`, row-parallel `o_proj`/`down_proj`, a 64-row-padded vocabulary, the fused vision
`attn.qkv`) and names their vLLM parameters. The live model supplies only the numbers of each layer: its
tensor-parallel size and rank (`tp_size`/`tp_rank`; 1/0 for replicated layers, e.g. a vision tower in
`mm_encoder_tp_mode="data"`), its vocabulary padding (`padding_size`) and the head sizes (its HF config). Every target
shape is checked against the live parameter, so a vLLM whose layout departs from the table fails at plan time
instead of syncing wrong values.

Repacking: vLLM's CPU backend runs `dispatch_cpu_unquantized_gemm` on every linear layer after loading (the
layer's `quant_method.process_weights_after_loading`): the weight becomes a oneDNN/SGL handle and `layer.weight`
an empty tensor (`remove_weight=True`), except for embeddings/LM heads, which keep their weight. Such layers carry a
`cpu_linear` attribute. The sync stages their new weight and calls the same post-load processing again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from rollplex_trl import vllm_compat
from rollplex_trl.rollout.layout import Target
from rollplex_trl.rollout.sources import TrainerTensor
from rollplex_trl.sharding.layouts import LayoutError, ShardSpec, VocabPadding, shape_2d
from rollplex_trl.sharding.models import ParamGroup, config_head_dims, match_groups

logger = logging.getLogger(__name__)

# HF name prefixes of the Qwen2.5-VL family; their vLLM names sit under `language_model.` / `visual.`
_VL_PREFIXES = ("model.language_model.", "model.visual.")


class VLLMTargets:
    """Targets of a live vLLM model (one rank's shard), for `WeightSync`."""

    def __init__(self, model: torch.nn.Module, sources: Iterable[TrainerTensor]):
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.targets: dict[str, Target] = {}
        self.skipped: list[str] = []  # trainer tensors vLLM has no parameter for
        shapes = {s.name: tuple(s.tensor.shape) for s in sources}
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(f"{type(model).__name__} has no `config`: the head sizes of its layout are unknown")
        is_vl = any(name.startswith(_VL_PREFIXES) for name in shapes)
        groups, unclaimed = match_groups(shapes, config_head_dims(config), is_vl)
        for name in unclaimed:
            # vLLM's own renaming of a tensor the table does not know, only to tell whether vLLM loads it
            if vllm_compat.hf_to_vllm_name(model, name) in self.params:
                raise LayoutError(f"vLLM loads {name}, which no parameter kind of rollplex_trl/sharding/models.py "
                                  "describes; add its Kind there")
            self.skipped.append(name)
        for group in groups:
            for spec in group.kind.vllm:
                self._add(group, spec)

    def _add(self, group: ParamGroup, spec: ShardSpec) -> None:
        name = group.vllm_name(spec)
        if name not in self.params:
            if not self._tied_lm_head(name):
                self.skipped += list(dict.fromkeys(group.hf_names[i] for i in spec.sources))
            return  # a tied LM head: vLLM shares the embedding, whose sync covers it
        module_name, attr = name.rsplit(".", 1)
        module = self.model.get_submodule(module_name)
        padding = VocabPadding(int(getattr(module, "padding_size", 1))) if spec.vocab else None
        # layers without these attributes (norms, convolutions) are whole on every rank
        tp, rank = int(getattr(module, "tp_size", 1)), int(getattr(module, "tp_rank", 0))
        shape, pieces = group.rank_layout(spec, tp, rank, name, padding)
        target = self._new_target(name, module_name, attr, module, shape)
        target.pieces = pieces
        self.targets[name] = target

    def _tied_lm_head(self, name: str) -> bool:
        return name.rsplit(".", 2)[-2:] == ["lm_head", "weight"] and getattr(
            getattr(self.model, "config", None), "tie_word_embeddings", False)

    def _new_target(self, name: str, module_name: str, attr: str, module: torch.nn.Module,
                    shape: tuple[int, ...]) -> Target:
        param = self.params[name]
        repacked = attr == "weight" and vllm_compat.is_repacked(module)
        keeps = repacked and param.numel() > 0
        if repacked and not keeps:
            # the unpacked tensor is gone; the layer still knows its partition sizes
            live = vllm_compat.partition_sizes(module)
        else:
            live = tuple(param.shape)
        if shape_2d(live) != shape:
            raise LayoutError(f"vLLM {name}: the sharding table gives this rank {shape}, vLLM holds {live} "
                              "(vLLM's layout changed, or the model is not one the table describes)")
        return Target(name=name, module_name=module_name, attr=attr, shape=live, dtype=param.dtype,
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
        vllm_compat.reprocess_weights(module)

"""Parameter kinds of Qwen2 and Qwen2.5-VL, declared once for HF, Megatron-Core and vLLM; and model enumeration.

The table below is the only model-specific knowledge in the planner: for every parameter kind, the HF tensors it is
made of and one :class:`~rollplex_trl.sharding.layouts.ShardSpec` per framework. Layer counts, shapes and head
counts come from the model itself (built on the meta device from its config, so no weights are needed), and every
tensor of every layer is matched to a kind by its HF name. A tensor that no kind claims is an error, so a new
architecture fails loudly instead of being planned wrongly.

Conventions (read from the HF, vLLM and Megatron-Core loaders; summarised in docs/sharding.md):
- Megatron-Core: per-query-group interleaved ``linear_qkv``; ``linear_fc1`` is ``[gate_k; up_k]`` per rank; row
  split for ``linear_proj`` / ``linear_fc2``; optional vocabulary padding (Megatron-LM's
  ``make_vocab_size_divisible_by * tp``). The vision tower is either replicated with HF names (Megatron-Bridge,
  ROLL) or sharded like the LLM with per-head interleaved QKV (verl / mbridge).
- vLLM: ``qkv_proj`` is ``[q_j; k_j; v_j]`` per rank with KV heads replicated when r exceeds them; ``gate_up_proj``
  is ``[gate_j; up_j]``; vocabulary padded to a multiple of 64; the vision tower is TP-sharded
  (``mm_encoder_tp_mode="weights"``) or replicated (``"data"``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from rollplex_trl.model_presets import PRESETS, preset_config  # noqa: F401 (PRESETS: re-exported)
from rollplex_trl.models.families import family_for, megatron_refusal
from rollplex_trl.sharding.layouts import (
    Concat,
    GroupInterleave,
    HFSourceSpec,
    LayoutError,
    PerRank,
    ShardSpec,
    SlicePair,
    SourceRows,
    VocabPadding,
    shard_index,
    slice_pairs,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LLM_LAYER = r"model\.(?:language_model\.)?layers\.\d+\."
LLM_TOP = r"model\.(?:language_model\.)?"
VIT_BLOCK = r"model\.visual\.blocks\.\d+\."
VIT_TOP = r"model\.visual\."

@dataclass(frozen=True)
class Kind:
    """One parameter kind: its HF sources (suffixes under a prefix matching ``scope``) and its two layouts."""

    key: str
    scope: str
    sources: tuple[HFSourceSpec, ...]
    megatron: tuple[ShardSpec, ...]
    vllm: tuple[ShardSpec, ...]
    tower: str = "llm"  # "vision": the vision tower's TP mode is switchable in both frameworks


def _src(suffix: str) -> HFSourceSpec:
    return HFSourceSpec(suffix)


def _qkv_sources(fmt: str) -> tuple[HFSourceSpec, ...]:
    return tuple(HFSourceSpec(fmt.format(x), "head_dim") for x in "qkv")


def _fused_qkv(suffix: str) -> tuple[HFSourceSpec, ...]:
    return tuple(HFSourceSpec(suffix, "head_dim", (i, 3)) for i in range(3))


COL, ROW = 0, 1
QKV_MEGATRON = GroupInterleave()
QKV_VLLM = PerRank(replicate=True)
GATE_UP = PerRank()

KINDS: tuple[Kind, ...] = (
    # ---- LLM decoder layer ----
    Kind("llm.qkv.weight", LLM_LAYER, _qkv_sources("self_attn.{}_proj.weight"),
         (ShardSpec("self_attention.linear_qkv.weight", (0, 1, 2), QKV_MEGATRON, COL),),
         (ShardSpec("self_attn.qkv_proj.weight", (0, 1, 2), QKV_VLLM, COL),)),
    Kind("llm.qkv.bias", LLM_LAYER, _qkv_sources("self_attn.{}_proj.bias"),
         (ShardSpec("self_attention.linear_qkv.bias", (0, 1, 2), QKV_MEGATRON, COL),),
         (ShardSpec("self_attn.qkv_proj.bias", (0, 1, 2), QKV_VLLM, COL),)),
    Kind("llm.o.weight", LLM_LAYER, (_src("self_attn.o_proj.weight"),),
         (ShardSpec("self_attention.linear_proj.weight", (0,), Concat(), ROW),),
         (ShardSpec("self_attn.o_proj.weight", (0,), Concat(), ROW),)),
    Kind("llm.gate_up.weight", LLM_LAYER, (_src("mlp.gate_proj.weight"), _src("mlp.up_proj.weight")),
         (ShardSpec("mlp.linear_fc1.weight", (0, 1), GATE_UP, COL),),
         (ShardSpec("mlp.gate_up_proj.weight", (0, 1), GATE_UP, COL),)),
    Kind("llm.down.weight", LLM_LAYER, (_src("mlp.down_proj.weight"),),
         (ShardSpec("mlp.linear_fc2.weight", (0,), Concat(), ROW),),
         (ShardSpec("mlp.down_proj.weight", (0,), Concat(), ROW),)),
    Kind("llm.input_norm", LLM_LAYER, (_src("input_layernorm.weight"),),
         (ShardSpec("input_layernorm.weight", (0,)),), (ShardSpec("input_layernorm.weight", (0,)),)),
    Kind("llm.post_norm", LLM_LAYER, (_src("post_attention_layernorm.weight"),),
         (ShardSpec("pre_mlp_layernorm.weight", (0,)),), (ShardSpec("post_attention_layernorm.weight", (0,)),)),
    # ---- LLM embedding, final norm, LM head ----
    Kind("llm.embed", LLM_TOP, (_src("embed_tokens.weight"),),
         (ShardSpec("embedding.word_embeddings.weight", (0,), Concat(), COL, vocab=True),),
         (ShardSpec("embed_tokens.weight", (0,), Concat(), COL, vocab=True),)),
    Kind("llm.final_norm", LLM_TOP, (_src("norm.weight"),),
         (ShardSpec("decoder.final_layernorm.weight", (0,)),), (ShardSpec("norm.weight", (0,)),)),
    Kind("llm.lm_head", "", (_src("lm_head.weight"),),
         (ShardSpec("output_layer.weight", (0,), Concat(), COL, vocab=True),),
         (ShardSpec("lm_head.weight", (0,), Concat(), COL, vocab=True),)),
    # ---- vision blocks (Megatron side: the sharded, Megatron-native tower; see vision modes) ----
    Kind("vit.qkv.weight", VIT_BLOCK, _fused_qkv("attn.qkv.weight"),
         (ShardSpec("self_attention.linear_qkv.weight", (0, 1, 2), QKV_MEGATRON, COL),),
         (ShardSpec("attn.qkv.weight", (0, 1, 2), QKV_VLLM, COL),), "vision"),
    Kind("vit.qkv.bias", VIT_BLOCK, _fused_qkv("attn.qkv.bias"),
         (ShardSpec("self_attention.linear_qkv.bias", (0, 1, 2), QKV_MEGATRON, COL),),
         (ShardSpec("attn.qkv.bias", (0, 1, 2), QKV_VLLM, COL),), "vision"),
    Kind("vit.proj.weight", VIT_BLOCK, (_src("attn.proj.weight"),),
         (ShardSpec("self_attention.linear_proj.weight", (0,), Concat(), ROW),),
         (ShardSpec("attn.proj.weight", (0,), Concat(), ROW),), "vision"),
    Kind("vit.proj.bias", VIT_BLOCK, (_src("attn.proj.bias"),),
         (ShardSpec("self_attention.linear_proj.bias", (0,)),), (ShardSpec("attn.proj.bias", (0,)),), "vision"),
    Kind("vit.gate_up.weight", VIT_BLOCK, (_src("mlp.gate_proj.weight"), _src("mlp.up_proj.weight")),
         (ShardSpec("mlp.linear_fc1.weight", (0, 1), GATE_UP, COL),),
         (ShardSpec("mlp.gate_up_proj.weight", (0, 1), GATE_UP, COL),), "vision"),
    Kind("vit.gate_up.bias", VIT_BLOCK, (_src("mlp.gate_proj.bias"), _src("mlp.up_proj.bias")),
         (ShardSpec("mlp.linear_fc1.bias", (0, 1), GATE_UP, COL),),
         (ShardSpec("mlp.gate_up_proj.bias", (0, 1), GATE_UP, COL),), "vision"),
    Kind("vit.down.weight", VIT_BLOCK, (_src("mlp.down_proj.weight"),),
         (ShardSpec("mlp.linear_fc2.weight", (0,), Concat(), ROW),),
         (ShardSpec("mlp.down_proj.weight", (0,), Concat(), ROW),), "vision"),
    Kind("vit.down.bias", VIT_BLOCK, (_src("mlp.down_proj.bias"),),
         (ShardSpec("mlp.linear_fc2.bias", (0,)),), (ShardSpec("mlp.down_proj.bias", (0,)),), "vision"),
    Kind("vit.norm1", VIT_BLOCK, (_src("norm1.weight"),),
         (ShardSpec("input_layernorm.weight", (0,)),), (ShardSpec("norm1.weight", (0,)),), "vision"),
    Kind("vit.norm2", VIT_BLOCK, (_src("norm2.weight"),),
         (ShardSpec("pre_mlp_layernorm.weight", (0,)),), (ShardSpec("norm2.weight", (0,)),), "vision"),
    # ---- vision patch embedding and merger ----
    Kind("vit.patch_embed", VIT_TOP, (_src("patch_embed.proj.weight"),),
         (ShardSpec("patch_embed.proj.weight", (0,)),), (ShardSpec("patch_embed.proj.weight", (0,)),), "vision"),
    Kind("merger.ln_q", VIT_TOP, (_src("merger.ln_q.weight"),),
         (ShardSpec("decoder.final_layernorm.weight", (0,)),), (ShardSpec("merger.ln_q.weight", (0,)),), "vision"),
    Kind("merger.fc1.weight", VIT_TOP, (_src("merger.mlp.0.weight"),),
         (ShardSpec("projection.encoder.linear_fc1.weight", (0,), Concat(), COL),),
         (ShardSpec("merger.mlp.0.weight", (0,), Concat(), COL),), "vision"),
    Kind("merger.fc1.bias", VIT_TOP, (_src("merger.mlp.0.bias"),),
         (ShardSpec("projection.encoder.linear_fc1.bias", (0,), Concat(), COL),),
         (ShardSpec("merger.mlp.0.bias", (0,), Concat(), COL),), "vision"),
    Kind("merger.fc2.weight", VIT_TOP, (_src("merger.mlp.2.weight"),),
         (ShardSpec("projection.encoder.linear_fc2.weight", (0,), Concat(), ROW),),
         (ShardSpec("merger.mlp.2.weight", (0,), Concat(), ROW),), "vision"),
    Kind("merger.fc2.bias", VIT_TOP, (_src("merger.mlp.2.bias"),),
         (ShardSpec("projection.encoder.linear_fc2.bias", (0,)),), (ShardSpec("merger.mlp.2.bias", (0,)),),
         "vision"),
)

_MEGATRON_PREFIX = [
    (r"model\.language_model\.layers\.(\d+)\.", r"language_model.decoder.layers.\1."),
    (r"model\.layers\.(\d+)\.", r"decoder.layers.\1."),
    (r"model\.language_model\.", "language_model."),
    (r"model\.visual\.blocks\.(\d+)\.", r"vision_model.decoder.layers.\1."),
    (r"model\.visual\.", "vision_model."),
    (r"model\.", ""),
]
_VLLM_PREFIX = [
    (r"model\.language_model\.", "language_model.model."),
    (r"model\.visual\.", "visual."),
    (r"model\.", "model."),
]


def _map_prefix(prefix: str, rules: list[tuple[str, str]], top: str) -> str:
    for pattern, repl in rules:
        if m := re.match(pattern, prefix):
            return m.expand(repl) + prefix[m.end():]
    return top if prefix == "" else prefix


@dataclass(frozen=True)
class ParamGroup:
    """One instance of a kind in a model (e.g. layer 7's QKV): its HF tensors' 2-D shapes and head sizes."""

    kind: Kind
    prefix: str
    hf_names: tuple[str, ...]  # per source (a fused HF tensor appears once per part)
    shapes: tuple[tuple[int, int], ...]  # per source, flattened to (rows, cols); 1-D tensors are (n, 1)
    units: tuple[int, ...]  # per source, rows per indivisible unit
    one_dim: bool  # the sources are 1-D (biases, norms)
    is_vl: bool

    @property
    def signature(self) -> tuple:
        """Groups with equal signatures have identical layouts (all decoder layers of one model do)."""
        return (self.kind.key, self.shapes, self.units)

    @cached_property
    def source_rows(self) -> list[np.ndarray]:
        """Row ids of each source in V (the sources stacked along dim 0, in the kind's order)."""
        out, start = [], 0
        for rows, _ in self.shapes:
            out.append(np.arange(start, start + rows))
            start += rows
        return out

    @property
    def num_cols(self) -> int:
        return self.shapes[0][1]

    @property
    def numel(self) -> int:
        return sum(r * c for r, c in self.shapes)

    def megatron_name(self, spec: ShardSpec) -> str:
        top = "language_model." if self.is_vl else ""
        return _map_prefix(self.prefix, _MEGATRON_PREFIX, top) + spec.name

    def vllm_name(self, spec: ShardSpec) -> str:
        top = "language_model." if self.is_vl else ""
        return _map_prefix(self.prefix, _VLLM_PREFIX, top) + spec.name

    def rank_layout(self, spec: ShardSpec, tp: int, rank: int, name: str, padding: VocabPadding | None = None,
                    framework: str = "vLLM") -> tuple[tuple[int, ...], list[SlicePair]]:
        """One rank's parameter ``name`` built from this group's HF tensors: its shape in the algebra's 2-D form
        and the narrow copies that fill it (what the live weight sync copies)."""
        rows, cols = shard_index(spec, [self.source_rows[i] for i in spec.sources],
                                 [self.units[i] for i in spec.sources], self.num_cols, tp, rank, padding,
                                 f"{framework} {name}")
        starts = np.cumsum([0] + [r for r, _ in self.shapes])
        sources = [SourceRows(hf, int(start), rows, src.part[0] * rows, src.part[1])
                   for hf, start, (rows, _), src in zip(self.hf_names, starts, self.shapes, self.kind.sources)]
        shape = (len(rows),) if self.one_dim else (len(rows), len(cols))
        return shape, slice_pairs(rows, cols, sources, self.num_cols, name)


@dataclass
class ModelSpec:
    """A model as the planner sees it: its parameter groups (shapes only) and its name."""

    name: str
    groups: list[ParamGroup]
    is_vl: bool
    config: object = field(repr=False, default=None)

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)


def config_head_dims(config: object) -> dict[str, int]:
    """Rows per attention head of each tower (the indivisible unit of q/k/v splits), from a HF config."""
    text = getattr(config, "text_config", config)
    llm = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dims = {"llm": llm}
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        dims["vision"] = vision.hidden_size // vision.num_heads
    return dims


def model_spec_from_config(config: PretrainedConfig, name: str | None = None) -> ModelSpec:
    """Enumerate a text model's or a registered family's parameters from its config (built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    refusal = megatron_refusal(config)  # the plan is Megatron's layouts against vLLM's: families it builds only
    if refusal is not None:
        raise LayoutError(refusal)
    family = family_for(config)
    is_vl = family is not None
    with torch.device("meta"):
        model = family.load_class()(config) if is_vl else AutoModelForCausalLM.from_config(config)
    # named_parameters() skips tied duplicates, so a tied LM head is simply absent (vLLM ties it too).
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return ModelSpec(name or getattr(config, "_name_or_path", "") or config.model_type,
                     groups_from_shapes(shapes, config_head_dims(config), is_vl), is_vl, config)


def groups_from_shapes(shapes: dict[str, tuple[int, ...]], head_dims: dict[str, int],
                       is_vl: bool) -> list[ParamGroup]:
    """Match every HF tensor to exactly one parameter kind; raise if one is left over."""
    groups, missing = match_groups(shapes, head_dims, is_vl)
    if missing:
        raise LayoutError(f"no sharding layout for {len(missing)} parameter(s), e.g. {missing[:3]}; "
                          "add a Kind to rollplex_trl/sharding/models.py")
    return groups


def match_groups(shapes: dict[str, tuple[int, ...]], head_dims: dict[str, int],
                 is_vl: bool) -> tuple[list[ParamGroup], list[str]]:
    """The parameter groups of the HF tensors ``shapes``, and the names no kind claims (in order)."""
    groups, claimed = [], set()
    for name in shapes:
        for kind in KINDS:
            first = kind.sources[0]
            if not name.endswith(first.suffix) or first.part[0] != 0:
                continue
            prefix = name[: len(name) - len(first.suffix)]
            if not re.fullmatch(kind.scope, prefix):
                continue
            names = tuple(prefix + s.suffix for s in kind.sources)
            if any(n not in shapes for n in names):
                continue
            flat, units = [], []
            for s, n in zip(kind.sources, names):
                shape = shapes[n]
                rows, cols = shape[0], int(np.prod(shape[1:])) if len(shape) > 1 else 1
                index, count = s.part
                if rows % count:
                    raise LayoutError(f"{n}: {rows} rows cannot be cut into {count} equal parts")
                flat.append((rows // count, cols))
                units.append(head_dims[kind.tower] if s.unit == "head_dim" else 1)
            groups.append(ParamGroup(kind, prefix, names, tuple(flat), tuple(units),
                                     len(shapes[names[0]]) == 1, is_vl))
            claimed.update(names)
    return groups, [n for n in shapes if n not in claimed]


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A preset name, a config.json file, or a directory holding one."""
    from pathlib import Path

    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        import json

        from transformers import AutoConfig

        values = json.loads(path.read_text())
        if "model_type" not in values:
            raise LayoutError(f"{path}: no 'model_type' in this config; expected a Hugging Face config.json")
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        return model_spec_from_config(config, name=str(name_or_path))
    config = preset_config(name_or_path)
    return model_spec_from_config(config, name=config._name_or_path)

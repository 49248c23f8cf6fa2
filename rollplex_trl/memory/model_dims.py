"""Model dimensions for the memory planner: the registered families' released shapes, or any HF ``config.json``.

Presets are the public ``config.json`` values of the Qwen2.5-VL-{3B,7B,32B,72B} and Qwen3-VL-{2B,4B,8B,32B}
Instruct checkpoints (each family's adapter in rollplex_trl/models/ holds its own; no weights are read). The
vision tower's layout (gated or plain MLP, RMSNorm or LayerNorm, learned position embeddings, DeepStack mergers)
comes from the family's `vision_layout`; counts are tested against the real modules built on the meta device. The 32B
figures are cross-checked in docs/sharding.md, "The per-logical-matrix accounting" (exact count: 33,452,718,336
parameters = LLM 32,763,876,352 + vision 688,841,984), and ``ModelDims.num_params()`` reproduces that count (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class VisionDims:
    depth: int = 32
    hidden: int = 1280
    intermediate: int = 3456
    heads: int = 16
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2  # spatial merge: merge**2 patches become one LLM token
    out_hidden: int = 5120
    in_channels: int = 3
    # The layout (defaults: Qwen2.5-VL's tower; Qwen3-VL: plain MLP, LayerNorm with bias, learned position
    # embeddings of 2304 slots, a biased patch embedding and three DeepStack mergers)
    gated_mlp: bool = True
    layer_norm: bool = False
    position_embeddings: int = 0
    deepstack_levels: int = 0
    # Attention (FLOPs only): most blocks attend within windows of `window` pixels per side of one frame (Qwen2.5-VL:
    # 112), `full_attention_blocks` of them over the whole frame (Qwen2.5-VL: 4 of 32); window 0: every block does
    window: int = 112
    full_attention_blocks: int = 4

    def _norm(self, width: int) -> int:
        return 2 * width if self.layer_norm else width  # LayerNorm has a bias, RMSNorm does not

    def block_params(self) -> int:
        h, i = self.hidden, self.intermediate
        qkv = h * 3 * h + 3 * h
        proj = h * h + h
        if self.gated_mlp:
            mlp = 2 * (i * h + i) + (h * i + h)  # gate, up (with bias) and down
        else:
            mlp = (i * h + i) + (h * i + h)  # fc1 and fc2
        return qkv + proj + mlp + 2 * self._norm(h)

    def _merger_params(self, post_shuffle_norm: bool) -> int:
        merged = self.hidden * self.merge**2
        norm = self._norm(merged if post_shuffle_norm else self.hidden)
        return norm + (merged * merged + merged) + (self.out_hidden * merged + self.out_hidden)

    def num_params(self) -> int:
        patch_embed = self.hidden * self.in_channels * self.temporal_patch * self.patch * self.patch
        patch_embed += self.hidden if self.layer_norm else 0  # Qwen3-VL's patch embedding has a bias
        positions = self.position_embeddings * self.hidden
        mergers = self._merger_params(False) + self.deepstack_levels * self._merger_params(True)
        return patch_embed + positions + self.depth * self.block_params() + mergers

    def norm_params(self) -> int:
        """Parameters every tensor-parallel rank holds in full (norm weights)."""
        return self.depth * 2 * self._norm(self.hidden) + self._norm(self.hidden)


@dataclass(frozen=True)
class ModelDims:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    vision: VisionDims | None = None
    qkv_bias: bool = True  # Qwen2's attention has q/k/v biases; Qwen3's has none
    qk_norm: bool = False  # Qwen3: a per-head RMSNorm on q and on k (head_dim weights each, on every rank)

    def layer_params(self, tp: int = 1) -> int:
        """One decoder layer's parameters on one of ``tp`` ranks (KV heads replicate when tp > kv_heads)."""
        h, d, bias = self.hidden, self.head_dim, int(self.qkv_bias)
        q = (h * self.heads * d + bias * self.heads * d) / tp
        kv = 2 * (h * d + bias * d) * self.kv_heads_per_rank(tp)
        o = self.heads * d * h / tp
        mlp = 3 * h * self.intermediate / tp
        return round(q + kv + o + mlp + 2 * h + (2 * d if self.qk_norm else 0))

    def kv_heads_per_rank(self, tp: int) -> float:
        """KV heads one rank holds: kv_heads / tp, or one replicated head when tp exceeds kv_heads."""
        return max(self.kv_heads / tp, 1.0)

    def llm_params(self, tp: int = 1) -> int:
        embed = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else embed
        return round(self.layers * self.layer_params(tp) + (embed + head) / tp + self.hidden)

    def vision_params(self, tp: int = 1) -> int:
        if self.vision is None:
            return 0
        replicated = self.vision.norm_params()
        return round((self.vision.num_params() - replicated) / tp + replicated)

    def num_params(self) -> int:
        return self.llm_params() + self.vision_params()

    def kv_bytes_per_token(self, tp: int = 1, bytes_per_value: int = 2) -> float:
        """K and V of every layer for one token, on one of ``tp`` ranks: 2 * layers * kv_heads/tp * head_dim * b."""
        return 2 * self.layers * self.kv_heads_per_rank(tp) * self.head_dim * bytes_per_value

    def layer_activation_values_per_token(self, tp: int = 1, sequence_parallel: bool = True) -> float:
        """Values autograd keeps per token for one decoder layer without recompute (flash attention, no dropout).

        Attention: RMSNorm input and output (2h), q/k/v after RoPE ((heads + 2 kv_heads) * head_dim), the
        attention output and its log-sum-exp (heads * head_dim; o_proj's input is the same tensor). MLP: RMSNorm
        input and output (2h), gate and up outputs and the SwiGLU product (3 * intermediate). Head- and
        intermediate-sized tensors are split over tp; hidden-sized ones too with sequence parallelism.
        """
        hid = 4 * self.hidden / (tp if sequence_parallel else 1)
        split = ((self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim
                 + 3 * self.intermediate) / tp
        return hid + split


def _presets() -> dict[str, ModelDims]:
    # One table of the released shapes serves both planners: rollplex_trl/model_presets.py gathers the families'.
    from rollplex_trl.model_presets import PRESETS as CONFIGS
    from rollplex_trl.model_presets import preset_config

    return {name: dims_from_config(preset_config(name), name) for name in CONFIGS}


def resolve_model(name_or_config: str) -> ModelDims:
    """A preset name (case-insensitive, "Qwen/" and "-Instruct" optional) or a path to an HF config.json / dir."""
    key = name_or_config.split("/")[-1].removesuffix("-Instruct").lower()
    for preset_name, dims in PRESETS.items():
        if preset_name.lower() == key:
            return dims
    path = Path(name_or_config)
    if path.exists():
        return from_hf_config(path)
    raise ValueError(f"unknown model {name_or_config!r}: use a preset ({', '.join(PRESETS)}) or the path of a "
                     "config.json (or a directory holding one)")


def from_hf_config(path: str | Path) -> ModelDims:
    """Read the dimensions from an HF config (a registered family, or a decoder-only LLM) with AutoConfig."""
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path.parent if path.is_file() else path))
    return dims_from_config(config, getattr(config, "_name_or_path", None) or path.name)


def dims_from_config(config: PretrainedConfig, name: str) -> ModelDims:
    """The dimensions of a transformers config object (VL configs have text_config/vision_config)."""
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    from rollplex_trl.models.families import family_for

    family = family_for(config)
    vision = None
    vc = getattr(config, "vision_config", None)
    if vc is not None:
        # a VL config no adapter claims (Qwen2-VL) is read with Qwen2.5-VL's layout
        layout = family.vision_layout if family is not None else None
        vit_hidden = getattr(vc, "hidden_size", None) or vc.embed_dim
        positions = getattr(vc, layout.position_embeddings_field) if layout and layout.position_embeddings_field else 0
        deepstack = len(getattr(vc, layout.deepstack_field)) if layout and layout.deepstack_field else 0
        # Qwen2-VL (read with Qwen2.5-VL's layout) has no window_size: every block attends over the whole frame
        window = (getattr(vc, layout.window_field, None) or 0) if layout and layout.window_field else 0
        full_blocks = len(getattr(vc, layout.full_attention_blocks_field, None) or ()) if window else vc.depth
        vision = VisionDims(
            depth=vc.depth,
            hidden=vit_hidden,
            intermediate=getattr(vc, "intermediate_size", None) or int(vit_hidden * getattr(vc, "mlp_ratio", 4)),
            heads=vc.num_heads,
            patch=vc.patch_size,
            temporal_patch=getattr(vc, "temporal_patch_size", 2),
            merge=getattr(vc, "spatial_merge_size", 2),
            out_hidden=getattr(vc, "out_hidden_size", None) or text.hidden_size,
            in_channels=getattr(vc, "in_channels", None) or getattr(vc, "in_chans", 3),
            gated_mlp=layout.gated_mlp if layout else True,
            layer_norm=layout.layer_norm if layout else False,
            position_embeddings=positions,
            deepstack_levels=deepstack,
            window=window,
            full_attention_blocks=full_blocks,
        )
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is None:
        tied = getattr(text, "tie_word_embeddings", False)
    return ModelDims(
        name=name,
        hidden=text.hidden_size,
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate=text.intermediate_size,
        vocab=text.vocab_size,
        tied_embeddings=bool(tied),
        vision=vision,
        qkv_bias=family.text_qkv_bias if family is not None else True,
        qk_norm=family.text_qk_norm if family is not None else False,
    )


PRESETS: dict[str, ModelDims] = _presets()  # after dims_from_config, which it uses

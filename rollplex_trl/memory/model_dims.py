"""Model dimensions for the memory planner: Qwen2.5-VL presets, or any HF ``config.json`` (no weights read).

Presets are the public ``config.json`` values of the Qwen2.5-VL-{3B,7B,32B,72B}-Instruct checkpoints. The 32B
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

    def block_params(self) -> int:
        h, i = self.hidden, self.intermediate
        qkv = h * 3 * h + 3 * h
        proj = h * h + h
        mlp = 2 * (i * h + i) + (h * i + h)  # gate, up (with bias) and down
        return qkv + proj + mlp + 2 * h  # two RMSNorm weights

    def num_params(self) -> int:
        patch_embed = self.hidden * self.in_channels * self.temporal_patch * self.patch * self.patch
        merged = self.hidden * self.merge**2
        merger = self.hidden + (merged * merged + merged) + (self.out_hidden * merged + self.out_hidden)
        return patch_embed + self.depth * self.block_params() + merger

    def norm_params(self) -> int:
        """Parameters every tensor-parallel rank holds in full (norm weights)."""
        return self.depth * 2 * self.hidden + self.hidden


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

    def layer_params(self, tp: int = 1) -> int:
        """One decoder layer's parameters on one of ``tp`` ranks (KV heads replicate when tp > kv_heads)."""
        h, d = self.hidden, self.head_dim
        q = (h * self.heads * d + self.heads * d) / tp
        kv = 2 * (h * d + d) * self.kv_heads_per_rank(tp)
        o = self.heads * d * h / tp
        mlp = 3 * h * self.intermediate / tp
        return round(q + kv + o + mlp + 2 * h)

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
    # One table of the released Qwen2.5-VL shapes serves both planners: rollplex_trl/model_presets.py holds it.
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
    """Read the dimensions from an HF config (Qwen2.5-VL, Qwen2-VL, or a decoder-only LLM) with AutoConfig."""
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path.parent if path.is_file() else path))
    return dims_from_config(config, getattr(config, "_name_or_path", None) or path.name)


def dims_from_config(config: PretrainedConfig, name: str) -> ModelDims:
    """The dimensions of a transformers config object (VL configs have text_config/vision_config)."""
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    vision = None
    vc = getattr(config, "vision_config", None)
    if vc is not None:
        vit_hidden = getattr(vc, "hidden_size", None) or vc.embed_dim
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
    )


PRESETS: dict[str, ModelDims] = _presets()  # after dims_from_config, which it uses

"""`ModelFamily`: everything the package asks of one vision-language family, in one record.

A family adapter (models/qwen2_5_vl.py, models/qwen3_vl.py) fills one of these; the registry (models/families.py)
lists them. Code elsewhere asks the registry (`family_for(config)`) instead of testing a `model_type` string, so a
new family is one module plus the contract test (tests/models/test_family_contract.py), which runs over every
registered family.

What stays generic and therefore is not a field: the prefix/suffix split reads positions from the backbone's own
`get_rope_index` (M-RoPE, interleaved or not, timestamps included) and hands visual features to the model's own
forward, so where the features enter the language model (Qwen3-VL's DeepStack: several early layers) is the model's
business; the contract test checks that the split stays exact anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from rollplex_trl.testing.tiny import Preset


@dataclass(frozen=True)
class VisionLayout:
    """How a family's vision tower is built, for the memory planner's parameter counts (memory/model_dims.py reads
    the sizes from the `vision_config`): a gated (SwiGLU) or plain MLP, RMSNorm or LayerNorm (with bias; then the
    patch embedding has a bias too), and the `vision_config` fields holding the learned position embeddings' count and
    the DeepStack levels (one merger each), if any."""

    gated_mlp: bool
    layer_norm: bool
    position_embeddings_field: str | None = None
    deepstack_field: str | None = None
    # window attention (the step model's vision attention FLOPs): the window side in pixels and the indexes of the
    # blocks that attend over the whole frame instead; without them every block attends over the whole frame
    window_field: str | None = None
    full_attention_blocks_field: str | None = None


@dataclass(frozen=True)
class ModelFamily:
    """One vision-language family.

    - `name`: how users name it (`--family`, `build-checkpoint --family`): "qwen2.5-vl".
    - `model_type`: transformers' `config.model_type`: "qwen2_5_vl".
    - `model_class`: the transformers class trained and loaded (`from_pretrained`).
    - `video_processor_class`: the class name of its video processor (how a processor is recognised).
    - `bounds_whole_clip`: its video processor bounds pixels over frames x height x width (Qwen3-VL) rather than per
      frame (Qwen2.5-VL); data/prompt.py then turns the processor's resize off for frames already sampled to size.
    - `megatron_refusal`: None when the Megatron backend builds this family; otherwise why it does not (the message
      the backend and `plan-sharding` raise at construction).
    - `text_qk_norm`, `text_qkv_bias`: the language model's attention layout, for the memory planner's counts.
    - `vision_layout`: how its vision tower is built, for the memory planner (`VisionLayout`).
    - `released`, `released_config`: the released checkpoints' names, and the config of one (no weights), for the
      planners.
    - `build_checkpoint`: writes a tiny random local checkpoint of a test preset (config, weights, tokenizer,
      processor) with `save_pretrained`, for tests, benchmarks and the main job.
    """

    name: str
    model_type: str
    model_class: str
    video_processor_class: str
    bounds_whole_clip: bool
    megatron_refusal: str | None
    text_qk_norm: bool
    text_qkv_bias: bool
    vision_layout: VisionLayout
    released: tuple[str, ...]
    released_config: Callable[[str], PretrainedConfig]
    build_checkpoint: Callable[[Path, Preset, int], None]

    def load_class(self) -> type:
        """The transformers class of this family (imported on first use)."""
        import transformers

        return getattr(transformers, self.model_class)

    def config_of(self, released_name: str) -> PretrainedConfig:
        """The config of one released checkpoint (no weights read)."""
        if released_name not in self.released:
            raise KeyError(f"{self.name} has no released shape {released_name!r}; shapes: {', '.join(self.released)}")
        config = self.released_config(released_name)
        config._name_or_path = f"Qwen/{released_name}-Instruct"
        return config

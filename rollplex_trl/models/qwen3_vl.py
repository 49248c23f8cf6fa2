"""The Qwen3-VL family (transformers' `qwen3_vl`, dense sizes): the second adapter.

What differs from Qwen2.5-VL, and where the package meets it:
- 16-pixel patches merged 2x2: frames are sampled at multiples of 32 (data/prepared.py reads it from the processor);
- its video processor bounds pixels over the whole clip, so the sampled frames' resize is turned off
  (`bounds_whole_clip`);
- DeepStack: the vision tower's features of a few blocks are also added to the LLM's first layers' hidden states at
  the visual positions. They sit at prefix positions, so the prefix K/V stays response-independent (tested in
  tests/models/test_family_contract.py, and prefix/vision_reuse.py keeps and permutes the DeepStack levels);
- text timestamps before each temporal patch of a video, and M-RoPE interleaved across t/h/w: both come from the
  processor and the backbone's own `get_rope_index`, which the prefix forward calls;
- a Qwen3 language model: per-head RMSNorm on q and k, no q/k/v bias;
- a LayerNorm vision tower with a plain (not gated) MLP and learned position embeddings.
The Megatron backend does not build it (megatron-core's GPT model here has no DeepStack injection and no interleaved
M-RoPE): a named refusal at construction.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rollplex_trl.models.family import ModelFamily, VisionLayout

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from rollplex_trl.testing.tiny import Preset

# The released dense Qwen3-VL-*-Instruct config.json values (vocabulary 151,936, head_dim 128, 8 KV heads,
# rope_theta 5e6, mrope_section [24, 20, 20] interleaved). Two vision towers: 24 blocks x 1024 (2B, 4B; DeepStack
# from blocks 5, 11, 17) and 27 blocks x 1152 (8B, 32B; blocks 8, 16, 24).
_SMALL_TOWER = dict(depth=24, hidden_size=1024, intermediate_size=4096, deepstack_visual_indexes=[5, 11, 17])
_LARGE_TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, deepstack_visual_indexes=[8, 16, 24])
RELEASED: dict[str, dict] = {
    "Qwen3-VL-2B": dict(text=dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                                  intermediate_size=6144), tie=True, vision=_SMALL_TOWER),
    "Qwen3-VL-4B": dict(text=dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                                  intermediate_size=9728), tie=True, vision=_SMALL_TOWER),
    "Qwen3-VL-8B": dict(text=dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                                  intermediate_size=12288), tie=False, vision=_LARGE_TOWER),
    "Qwen3-VL-32B": dict(text=dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                                   intermediate_size=25600), tie=False, vision=_LARGE_TOWER),
}
_TEXT_COMMON = dict(num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                    max_position_embeddings=262144, attention_bias=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                                     "mrope_interleaved": True})
_VISION_COMMON = dict(num_heads=16, patch_size=16, temporal_patch_size=2, in_channels=3, spatial_merge_size=2,
                      num_position_embeddings=2304)


def released_config(name: str) -> PretrainedConfig:
    from transformers import Qwen3VLConfig

    p = RELEASED[name]
    text = dict(_TEXT_COMMON, **p["text"], tie_word_embeddings=p["tie"])
    vision = dict(_VISION_COMMON, **p["vision"], out_hidden_size=p["text"]["hidden_size"])
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=p["tie"])


def build_checkpoint(out_dir: Path, preset: Preset, seed: int) -> None:
    """A random Qwen3-VL of the test preset's sizes with Qwen3-VL's own layout: 16-pixel patches (32 per merged
    token), interleaved M-RoPE, DeepStack from the tower's first blocks, at least 3 LLM layers so that every DeepStack
    level feeds a layer with a gradient. The DeepStack mergers' weights are scaled up 10x: at random init their
    contribution is too small for a test to see a mistake in it. Qwen3-VL renders a video in the chat template as
    Qwen2.5-VL does; its processor adds a timestamp before each temporal patch."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from rollplex_trl.testing import tiny as ck

    tokenizer = ck.build_tokenizer(preset.text.vocab_size)
    text_kwargs = ck.text_config_kwargs(preset.text, tokenizer, with_mrope=False)
    text_kwargs["num_hidden_layers"] = max(3, preset.text.num_hidden_layers)
    text_kwargs["head_dim"] = preset.text.head_dim
    text_kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 5_000_000.0,
                                      "mrope_section": list(preset.text.mrope_section), "mrope_interleaved": True}
    v = preset.vision
    patch, ids = 16, ck.special_token_ids(tokenizer)
    config = Qwen3VLConfig(
        text_config=text_kwargs,
        vision_config=dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                           num_heads=v.num_heads, out_hidden_size=preset.text.hidden_size, patch_size=patch,
                           spatial_merge_size=v.spatial_merge_size, temporal_patch_size=v.temporal_patch_size,
                           num_position_embeddings=64, deepstack_visual_indexes=list(range(min(v.depth, 2)))),
        image_token_id=ids[ck.IMAGE_PAD], video_token_id=ids[ck.VIDEO_PAD],
        vision_start_token_id=ids[ck.VISION_START], vision_end_token_id=ids[ck.VISION_END], tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(getattr(torch, preset.dtype))
    with torch.no_grad():
        for merger in model.model.visual.deepstack_merger_list:
            for weight in merger.parameters():
                if weight.dim() > 1:
                    weight.mul_(10.0)
    ck.save_model(model, tokenizer, out_dir)
    unit = (patch * v.spatial_merge_size) ** 2  # pixels per merged token
    pixels = dict(patch_size=patch, merge_size=v.spatial_merge_size, temporal_patch_size=v.temporal_patch_size)
    processor = Qwen3VLProcessor(
        # 4..max_pixels / 28² merged tokens per image, as the Qwen2.5-VL builder's processor allows
        image_processor=Qwen2VLImageProcessor(**pixels, size={"shortest_edge": 4 * unit,
                                                               "longest_edge": preset.max_pixels // 28**2 * unit}),
        tokenizer=tokenizer,
        # Qwen3-VL's video processor bounds the whole clip (frames x height x width), not each frame; its
        # uncapped behaviour chosen explicitly (transformers warns while the default is unset)
        video_processor=Qwen3VLVideoProcessor(**pixels, size={"shortest_edge": 4 * unit, "longest_edge": 512 * unit},
                                              cap_pixels_per_frame=False),
        chat_template=ck.QWEN2_5_VL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)


FAMILY = ModelFamily(
    name="qwen3-vl",
    model_type="qwen3_vl",
    model_class="Qwen3VLForConditionalGeneration",
    video_processor_class="Qwen3VLVideoProcessor",
    bounds_whole_clip=True,
    megatron_refusal=("Qwen3-VL's DeepStack injections and interleaved M-RoPE are not expressed in the Megatron "
                      "backend's megatron-core GPT model"),
    text_qk_norm=True,
    text_qkv_bias=False,
    vision_layout=VisionLayout(gated_mlp=False, layer_norm=True,
                               position_embeddings_field="num_position_embeddings",
                               deepstack_field="deepstack_visual_indexes"),
    released=tuple(RELEASED),
    released_config=released_config,
    build_checkpoint=build_checkpoint,
)

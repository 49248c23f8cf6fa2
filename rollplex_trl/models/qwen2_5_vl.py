"""The Qwen2.5-VL family (transformers' `qwen2_5_vl`): the package's first adapter.

Layout: 14-pixel patches merged 2x2 (28 pixels per LLM token), a windowed-attention vision tower with RMSNorm and a
gated MLP, one merger whose output replaces the video/image pad tokens at the LLM's input, M-RoPE over (t, h, w)
in contiguous sections with video time scaled by `second_per_grid_ts`. The Megatron backend builds it
(backends/megatron/model.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rollplex_trl.models.family import ModelFamily, VisionLayout

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from rollplex_trl.testing.tiny import Preset

# The released config.json values. Qwen2.5-VL-32B has 40 query heads (not 64: that is the 72B model), and the 3B/7B
# vision MLP is 3420 wide (32B/72B: 3456).
RELEASED: dict[str, dict] = {
    "Qwen2.5-VL-3B": dict(text=dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                                     num_key_value_heads=2, intermediate_size=11008, vocab_size=151936),
                          tie=True, vision=dict(intermediate_size=3420, out_hidden_size=2048)),
    "Qwen2.5-VL-7B": dict(text=dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                     num_key_value_heads=4, intermediate_size=18944, vocab_size=152064),
                          tie=False, vision=dict(intermediate_size=3420, out_hidden_size=3584)),
    "Qwen2.5-VL-32B": dict(text=dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
                                      num_key_value_heads=8, intermediate_size=27648, vocab_size=152064),
                           tie=False, vision=dict(intermediate_size=3456, out_hidden_size=5120)),
    "Qwen2.5-VL-72B": dict(text=dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                      num_key_value_heads=8, intermediate_size=29568, vocab_size=152064),
                           tie=False, vision=dict(intermediate_size=3456, out_hidden_size=8192)),
}
_VISION_COMMON = dict(depth=32, hidden_size=1280, num_heads=16, patch_size=14, temporal_patch_size=2,
                      in_channels=3, spatial_merge_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])


def released_config(name: str) -> PretrainedConfig:
    from transformers import Qwen2_5_VLConfig

    p = RELEASED[name]
    text = dict(p["text"], tie_word_embeddings=p["tie"], rms_norm_eps=1e-6, max_position_embeddings=128000)
    return Qwen2_5_VLConfig(text_config=text, vision_config=dict(_VISION_COMMON, **p["vision"]),
                            tie_word_embeddings=p["tie"])


def build_checkpoint(out_dir: Path, preset: Preset, seed: int) -> None:
    """A random Qwen2.5-VL of the test preset's sizes, Qwen2.5-VL's processor (per-frame pixel caps as qwen-vl-utils
    does), our small tokenizer and Qwen2.5-VL's chat template."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from rollplex_trl.testing import tiny as ck

    tokenizer = ck.build_tokenizer(preset.text.vocab_size)
    text_kwargs = ck.text_config_kwargs(preset.text, tokenizer, with_mrope=True)
    v = preset.vision
    ids = ck.special_token_ids(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config=text_kwargs,
        vision_config=dict(
            depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_heads=v.num_heads,
            out_hidden_size=preset.text.hidden_size, patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size,
            temporal_patch_size=v.temporal_patch_size, window_size=v.window_size,
            fullatt_block_indexes=list(v.fullatt_block_indexes), tokens_per_second=v.tokens_per_second,
        ),
        image_token_id=ids[ck.IMAGE_PAD], video_token_id=ids[ck.VIDEO_PAD],
        vision_start_token_id=ids[ck.VISION_START], vision_end_token_id=ids[ck.VISION_END],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(getattr(torch, preset.dtype))
    ck.save_model(model, tokenizer, out_dir)

    pixel_kwargs = dict(min_pixels=preset.min_pixels, max_pixels=preset.max_pixels, patch_size=v.patch_size,
                        merge_size=v.spatial_merge_size, temporal_patch_size=v.temporal_patch_size)
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**pixel_kwargs),
        tokenizer=tokenizer,
        # cap_pixels_per_frame: qwen-vl-utils' per-frame pixel cap (the reference behaviour, default from v5.22).
        video_processor=Qwen2VLVideoProcessor(**pixel_kwargs, cap_pixels_per_frame=True),
        chat_template=ck.QWEN2_5_VL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)


FAMILY = ModelFamily(
    name="qwen2.5-vl",
    model_type="qwen2_5_vl",
    model_class="Qwen2_5_VLForConditionalGeneration",
    video_processor_class="Qwen2VLVideoProcessor",
    bounds_whole_clip=False,
    megatron_refusal=None,
    text_qk_norm=False,
    text_qkv_bias=True,
    vision_layout=VisionLayout(gated_mlp=True, layer_norm=False, window_field="window_size",
                               full_attention_blocks_field="fullatt_block_indexes"),
    released=tuple(RELEASED),
    released_config=released_config,
    build_checkpoint=build_checkpoint,
)

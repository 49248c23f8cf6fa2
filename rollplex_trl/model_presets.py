"""The released Qwen2.5-VL shapes, one table for both planners (sharding/ and memory/): configs without weights.

A leaf module (transformers only), so the sharding planner and the memory planner read it without importing each
other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Qwen2_5_VLConfig

# Real Qwen2.5-VL configs (the released config.json values). Qwen2.5-VL-32B has 40 query heads (not 64: that is
# the 72B model), and the 3B/7B vision MLP is 3420 wide (32B/72B: 3456), as the released configs give.
PRESETS: dict[str, dict] = {
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


def preset_config(name: str) -> Qwen2_5_VLConfig:
    """A ``Qwen2_5_VLConfig`` for one of :data:`PRESETS` (case-insensitive, "Qwen/" prefix and "-Instruct" ok)."""
    from transformers import Qwen2_5_VLConfig

    key = name.split("/")[-1].removesuffix("-Instruct").lower()
    match = {k.lower(): k for k in PRESETS}.get(key)
    if match is None:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)} (or pass a config.json path)")
    p = PRESETS[match]
    text = dict(p["text"], tie_word_embeddings=p["tie"], rms_norm_eps=1e-6, max_position_embeddings=128000)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(_VISION_COMMON, **p["vision"]),
                              tie_word_embeddings=p["tie"])
    config._name_or_path = f"Qwen/{match}-Instruct"
    return config

"""The released shapes of every registered family, one table for both planners (sharding/ and memory/): configs
without weights. Each family's adapter holds its own (models/qwen2_5_vl.py, models/qwen3_vl.py); this module is the
union the planners read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollplex_trl.models.families import FAMILIES, ModelFamily

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# released name -> its family ("Qwen2.5-VL-7B" -> qwen2.5-vl, "Qwen3-VL-8B" -> qwen3-vl)
PRESETS: dict[str, ModelFamily] = {name: family for family in FAMILIES.values() for name in family.released}


def preset_key(name: str) -> str | None:
    """The preset a user's name means (case-insensitive, "Qwen/" prefix and "-Instruct" optional), or None."""
    key = name.split("/")[-1].removesuffix("-Instruct").lower()
    return {k.lower(): k for k in PRESETS}.get(key)


def preset_config(name: str) -> PretrainedConfig:
    """The config of one of :data:`PRESETS` (case-insensitive, "Qwen/" prefix and "-Instruct" ok)."""
    match = preset_key(name)
    if match is None:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)} (or pass a config.json path)")
    return PRESETS[match].config_of(match)

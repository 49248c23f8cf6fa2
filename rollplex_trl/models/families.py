"""The registry of vision-language families, and what the rest of the package asks through it.

Each family is one adapter module (models/qwen2_5_vl.py, models/qwen3_vl.py) holding a `ModelFamily`
(models/family.py); `FAMILIES` lists them. Adding a family: write its module, add it here, pass
tests/models/test_family_contract.py (docs/families.md).

- `family_for(config)`: the family of a loaded config / model type, or None (text models, unknown families).
- `family_named(name)`: by user-facing name ("qwen3-vl"; "qwen3_vl" accepted too).
- `SHARED_PREFIX_MODEL_TYPES`: the decoders whose prefix/suffix split is tested exact against their own forward:
  every registered family plus the text decoders (Qwen2, Llama).
- `frame_factor`: frames are sampled at multiples of the video processor's patch x spatial merge (28 pixels on
  Qwen2.5-VL, 32 on Qwen3-VL), so the processor patches them as they are.
- `video_resize_kwargs`: how to tell the video processor not to resize the sampled frames again.
- `processor_video_sampling`: the frame sampling the processor's own video settings describe
  (`rollplex_video_sampling="processor"`).
- `megatron_refusal`: why the Megatron backend cannot build a config, or None.
"""

from __future__ import annotations

from typing import Any

from rollplex_trl.models import qwen2_5_vl, qwen3_vl
from rollplex_trl.models.family import ModelFamily

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (qwen2_5_vl.FAMILY, qwen3_vl.FAMILY)}

TEXT_MODEL_TYPES = ("qwen2", "llama")
SHARED_PREFIX_MODEL_TYPES = tuple(f.model_type for f in FAMILIES.values()) + TEXT_MODEL_TYPES
# vision-language families the Megatron backend builds (backends/megatron/model.py: megatron-core's GPT model with
# M-RoPE and the HF vision tower); text models it builds from their config alone
MEGATRON_VL_MODEL_TYPES = tuple(f.model_type for f in FAMILIES.values() if f.megatron_refusal is None)


def family_for(config_or_type: Any) -> ModelFamily | None:
    """The registered family of a config (or model, or `model_type` string), or None."""
    model_type = config_or_type if isinstance(config_or_type, str) else getattr(
        getattr(config_or_type, "config", config_or_type), "model_type", "")
    return next((f for f in FAMILIES.values() if f.model_type == model_type), None)


def family_named(name: str) -> ModelFamily:
    """A family by its name ("qwen2.5-vl", "qwen3-vl") or model type ("qwen2_5_vl", "qwen3_vl")."""
    for family in FAMILIES.values():
        if name in (family.name, family.model_type):
            return family
    raise ValueError(f"unknown model family {name!r}; registered: {', '.join(FAMILIES)}")


def megatron_refusal(config: Any) -> str | None:
    """Why the Megatron backend cannot build this model, or None. A vision-language family it does not know would
    otherwise be built as a text model and silently lose its vision inputs."""
    if getattr(config, "vision_config", None) is None:
        return None
    model_type = getattr(config, "model_type", "")
    family = family_for(model_type)
    if family is not None and family.megatron_refusal is None:
        return None
    why = family.megatron_refusal if family is not None else "it is not a registered family (models/families.py)"
    return (f"rollplex_backend='megatron' does not build {model_type!r} models (vision-language families it "
            f"builds: {MEGATRON_VL_MODEL_TYPES}): {why}. Use rollplex_backend='hf'.")


def _video_processor(processor: Any) -> Any:
    return getattr(processor, "video_processor", None)


def frame_factor(processor: Any) -> int | None:
    """The multiple of frame height and width the processor's video processor patches exactly (patch size x spatial
    merge), or None where the processor has no video processor with those sizes."""
    video = _video_processor(processor)
    patch, merge = getattr(video, "patch_size", None), getattr(video, "merge_size", None)
    return int(patch) * int(merge) if patch and merge else None


def bounds_whole_clip(processor: Any) -> bool:
    """Whether the processor's video processor is a registered family's that bounds its pixels over the whole clip
    (frames x height x width: Qwen3-VL's) rather than per frame (Qwen2-VL's and Qwen2.5-VL's)."""
    name = type(_video_processor(processor)).__name__
    return any(f.bounds_whole_clip and f.video_processor_class == name for f in FAMILIES.values())


def video_resize_kwargs(processor: Any, pixel_bounds: tuple[int, int]) -> dict[str, Any]:
    """The processor's `videos_kwargs` that keep the sampled frames' size (they are already resized, at multiples of
    `frame_factor`, within `pixel_bounds` per frame). Per-frame bounds equal to the sampling's make the processor's
    own resize a no-op (Qwen2.5-VL: the same arithmetic); a processor that bounds the whole clip would shrink the
    frames again, so its resize is turned off instead."""
    if bounds_whole_clip(processor):
        return {"do_resize": False}
    return {"size": {"shortest_edge": pixel_bounds[0], "longest_edge": pixel_bounds[1]}}


def _size_bounds(video: Any) -> tuple[int, int]:
    size = getattr(video, "size", None) or {}
    get = size.get if isinstance(size, dict) else lambda key: getattr(size, key, None)
    low = get("shortest_edge") or getattr(video, "min_pixels", None)
    high = get("longest_edge") or getattr(video, "max_pixels", None)
    if not low or not high:
        raise ValueError(f"{type(video).__name__} has no pixel bounds (size shortest_edge / longest_edge) to sample "
                         "frames from; use rollplex_video_sampling='config' and the rollplex_video_* fields")
    return int(low), int(high)


# qwen-vl-utils' FPS: what Qwen2-VL's and Qwen2.5-VL's video processors sample at (they carry no fps of their own)
DEFAULT_VIDEO_FPS = 2.0


def processor_video_sampling(processor: Any) -> dict[str, Any]:
    """`VideoSamplingConfig` fields from the processor's own video settings: its fps (2 where it has none), its
    min/max frames, and its pixel bounds, per frame (Qwen2.5-VL: `size` shortest/longest edge) or over frames x
    height x width of the whole clip (Qwen3-VL: then each frame is at least one merged token)."""
    video = _video_processor(processor)
    if video is None:
        raise ValueError(f"{type(processor).__name__} has no video processor; use rollplex_video_sampling='config'")
    capped = bool(getattr(video, "cap_pixels_per_frame", None))  # transformers' qwen-vl-utils-style budget
    low, high = _size_bounds(video)
    factor = frame_factor(processor) or 1
    fields: dict[str, Any] = dict(fps=float(getattr(video, "fps", None) or DEFAULT_VIDEO_FPS),
                                  min_frames=int(video.min_frames), max_frames=int(video.max_frames))
    if bounds_whole_clip(processor):
        if capped:
            # Qwen3-VL's cap floors each frame's budget at 1.05 x the clip's minimum, which these bounds cannot
            # express: refused rather than sampled differently from the processor
            raise ValueError(f"rollplex_video_sampling='processor' does not reproduce {type(video).__name__}'s "
                             "cap_pixels_per_frame=True yet; set it to False in the processor, or use "
                             "rollplex_video_sampling='config' with rollplex_video_max_pixels")
        fields.update(min_pixels=factor**2, max_pixels=high, clip_min_pixels=low, clip_max_pixels=high)
    else:
        fields.update(min_pixels=low, max_pixels=high)
        if capped:  # Qwen2-VL's cap is qwen-vl-utils' total_pixels: 90% of max_video_tokens' pixels, shared per frame
            fields["total_pixels"] = int(video.max_video_tokens * factor * factor * 0.9)
    return fields

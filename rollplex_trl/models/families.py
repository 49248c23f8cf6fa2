"""The model families the package knows, and what it asks of each one's processor: the start of one seam.

Issue 36 asks that supporting a vision-language family be one module plus its tests. This module holds the first
entries; the rest of the Qwen2.5-VL knowledge (the Megatron model, the sharding layouts, the memory planner's
dimensions) still sits in those components and moves here as they learn a second family.

- `SHARED_PREFIX_MODEL_TYPES`: the decoders whose prefix/suffix split is tested exact against their own forward
  (tests/prefix/: Qwen2, Llama, Qwen2.5-VL, and Qwen3-VL with its DeepStack, timestamps and interleaved M-RoPE).
- `frame_factor`: frames are sampled at multiples of the video processor's patch x spatial merge (28 pixels on
  Qwen2.5-VL, 32 on Qwen3-VL), so the processor patches them as they are.
- `video_resize_kwargs`: how to tell the video processor not to resize the sampled frames again.
"""

from __future__ import annotations

from typing import Any

SHARED_PREFIX_MODEL_TYPES = ("qwen2", "qwen2_5_vl", "qwen3_vl", "llama")
# vision-language families the Megatron backend builds (backends/megatron/model.py: megatron-core's GPT model with
# M-RoPE and the HF vision tower); text models it builds from their config alone
MEGATRON_VL_MODEL_TYPES = ("qwen2_5_vl",)


def megatron_refusal(config: Any) -> str | None:
    """Why the Megatron backend cannot build this model, or None. A vision-language family it does not know would
    otherwise be built as a text model and silently lose its vision inputs."""
    model_type = getattr(config, "model_type", "")
    if getattr(config, "vision_config", None) is not None and model_type not in MEGATRON_VL_MODEL_TYPES:
        return (f"rollplex_backend='megatron' does not build {model_type!r} models (vision-language families it "
                f"builds: {MEGATRON_VL_MODEL_TYPES}; Qwen3-VL's DeepStack injections and interleaved M-RoPE are not "
                "expressed in its megatron-core GPT model). Use rollplex_backend='hf'.")
    return None


def _video_processor(processor: Any) -> Any:
    return getattr(processor, "video_processor", None)


def frame_factor(processor: Any) -> int | None:
    """The multiple of frame height and width the processor's video processor patches exactly (patch size x spatial
    merge), or None where the processor has no video processor with those sizes."""
    video = _video_processor(processor)
    patch, merge = getattr(video, "patch_size", None), getattr(video, "merge_size", None)
    return int(patch) * int(merge) if patch and merge else None


def bounds_whole_clip(processor: Any) -> bool:
    """Whether the video processor reads its pixel bounds for the whole clip (frames x height x width: Qwen3-VL's)
    rather than per frame (Qwen2-VL's and Qwen2.5-VL's)."""
    return type(_video_processor(processor)).__name__.startswith("Qwen3VL")


def video_resize_kwargs(processor: Any, pixel_bounds: tuple[int, int]) -> dict[str, Any]:
    """The processor's `videos_kwargs` that keep the sampled frames' size (they are already resized, at multiples of
    `frame_factor`, within `pixel_bounds` per frame). Per-frame bounds equal to the sampling's make the processor's
    own resize a no-op (Qwen2.5-VL: the same arithmetic); a processor that bounds the whole clip would shrink the
    frames again, so its resize is turned off instead."""
    if bounds_whole_clip(processor):
        return {"do_resize": False}
    return {"size": {"shortest_edge": pixel_bounds[0], "longest_edge": pixel_bounds[1]}}

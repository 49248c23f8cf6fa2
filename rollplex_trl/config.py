"""`RollplexGRPOConfig`: TRL's `GRPOConfig` plus the `rollplex_*` fields.

Every field has a `help` text and a default that is safe: exact, and never slower than TRL when it cannot help.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from trl import GRPOConfig


@dataclass
class RollplexGRPOConfig(GRPOConfig):
    r"""Configuration for [`RollplexGRPOTrainer`]: everything of [`trl.GRPOConfig`] plus the fields below.

    Parameters that control the shared prefix:
        rollplex_share_prefix (`"auto"`, `"on"` or `"off"`, defaults to `"auto"`): compute each prompt's prefix (vision
            tower + prompt tokens) once per group of G completions in the reference, old and actor log-prob passes,
            and run only the completions against its keys/values. Exact (same log-probs, losses and gradients up to
            float rounding). `"auto"` turns it on where the configuration supports it and logs the reason once where
            it does not; `"on"` raises instead; `"off"` runs TRL's full forward for every completion.
        rollplex_prefix_chunk_prompts (`int`, defaults to `8`): unique prompts per prefix forward in the no-grad
            (reference/old) passes; bounds their peak memory like TRL's per-device batch does.

    Parameters that control video data (used when a dataset row has a `video` column):
        rollplex_video_fps (`float`, defaults to `2.0`): frames sampled per second of video (qwen-vl-utils' FPS).
        rollplex_video_min_frames (`int`, defaults to `4`): fewest frames sampled from one video.
        rollplex_video_max_frames (`int`, defaults to `16`): most frames sampled from one video (Video-R1 uses 16).
        rollplex_video_min_pixels (`int`, defaults to `16 * 28 * 28`): lower bound on pixels per sampled frame.
        rollplex_video_max_pixels (`int`, defaults to `128 * 28 * 28`): upper bound on pixels per sampled frame
            (Video-R1 trains with 128 * 28 * 28).
        rollplex_max_prompt_length (`int` or `None`, defaults to `None`): budget for prompt tokens, visual tokens
            included. A longer prompt is an error (or skipped, see below); it is never cut, because cutting would
            drop visual tokens and desynchronise them from the pixel inputs.
        rollplex_skip_invalid_samples (`bool`, defaults to `False`): skip samples whose video or image is missing
            or undecodable, or whose prompt exceeds the budget, instead of raising. Skipped samples are replaced by
            the next valid one and counted in the `rollplex/skipped_samples` metric.
        rollplex_media_cache_size (`int`, defaults to `64`): prepared prompts (decoded frames and processor output)
            kept in memory, so that the G copies of a prompt and the repeated generation batches decode once.
    """

    rollplex_share_prefix: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata={
            "help": "Compute each prompt's prefix (vision tower + prompt) once per group of G completions in the "
            "reference, old and actor log-prob passes. 'auto': on where supported, otherwise off with the reason "
            "logged once; 'on': error where unsupported; 'off': TRL's full forward for every completion.",
            "choices": ["auto", "on", "off"],
        },
    )
    rollplex_prefix_chunk_prompts: int = field(
        default=8,
        metadata={"help": "Unique prompts per prefix forward in the no-grad (reference/old) log-prob passes."},
    )
    rollplex_overlap: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata={
            "help": "Run the prefix work of a step (reference, old-policy and actor prefixes) inside the rollout's "
            "decode window, at the same weights. 'auto': measure the first steps and keep it only where it shortens "
            "the step (decision logged); 'on': always; 'off': prefixes computed when scored. Needs the shared prefix; "
            "works with transformers' generate and with the vLLM engine (use_vllm=True).",
            "choices": ["auto", "on", "off"],
        },
    )
    rollplex_vllm_dtype: str = field(
        default="auto",
        metadata={"help": "dtype of the colocated vLLM engine (use_vllm=True, vllm_mode='colocate'). 'auto' is TRL's "
                  "choice (vLLM picks: the checkpoint's dtype, bf16 for fp32 checkpoints on CPU). Set the trainer's "
                  "dtype (e.g. 'float32', 'bfloat16') for sampling log-probs that match the trainer's exactly and "
                  "for weight aliasing, which needs equal dtypes."},
    )
    rollplex_overlap_threads: int = field(
        default=0,
        metadata={"help": "CPU only: intra-op threads of the prefix worker (0: half the cores); the decoding thread "
                  "keeps its own count."},
    )
    rollplex_overlap_timeout_s: float = field(
        default=600.0,
        metadata={"help": "Longest wait for a prefix job after decoding ends before the step fails with its name."},
    )
    rollplex_timeline: bool = field(
        default=False,
        metadata={"help": "Write the phase timeline of the run (Chrome-trace JSON and a Gantt PNG) to output_dir."},
    )
    rollplex_memory_ledger: bool = field(
        default=True,
        metadata={
            "help": "Keep a memory ledger by lifetime class and phase (rollout, train, optimizer, ...) and log it as "
            "rollplex/mem_*. Observation only: it moves nothing."
        },
    )
    rollplex_video_fps: float = field(
        default=2.0, metadata={"help": "Frames sampled per second of video, as qwen-vl-utils does (FPS)."}
    )
    rollplex_video_min_frames: int = field(default=4, metadata={"help": "Fewest frames sampled from one video."})
    rollplex_video_max_frames: int = field(
        default=16, metadata={"help": "Most frames sampled from one video (Video-R1 trains with 16)."}
    )
    rollplex_video_min_pixels: int = field(
        default=16 * 28 * 28, metadata={"help": "Lower bound on the pixels of one sampled video frame."}
    )
    rollplex_video_max_pixels: int = field(
        default=128 * 28 * 28,
        metadata={"help": "Upper bound on the pixels of one sampled video frame (Video-R1: 128*28*28)."},
    )
    rollplex_max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Budget for prompt tokens, visual tokens included. Longer prompts raise an error naming the "
            "sample (or are skipped with rollplex_skip_invalid_samples); they are never truncated, because cutting "
            "a prompt would cut visual tokens. None means no budget."
        },
    )
    rollplex_skip_invalid_samples: bool = field(
        default=False,
        metadata={
            "help": "Skip samples with a missing or undecodable video/image or an over-budget prompt instead of "
            "raising. Each skipped sample is replaced by the next valid one and counted in rollplex/skipped_samples."
        },
    )
    rollplex_media_cache_size: int = field(
        default=64,
        metadata={
            "help": "How many prepared prompts (decoded frames + processor output) to keep in memory, so the G "
            "copies of a prompt and repeated generation batches decode each video once."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _validate(self)


def rollplex_field_names() -> list[str]:
    """Names of the fields RollplexGRPOConfig adds to GRPOConfig."""
    base = {f.name for f in fields(GRPOConfig)}
    return [f.name for f in fields(RollplexGRPOConfig) if f.name not in base]


def rollplex_options(args: Any) -> dict[str, Any]:
    """The rollplex_* values of ``args``; a plain GRPOConfig gets the (safe) defaults."""
    defaults = {f.name: f.default for f in fields(RollplexGRPOConfig)}
    return {name: getattr(args, name, defaults[name]) for name in rollplex_field_names()}


# vLLM's dtype names (ModelConfig.dtype)
_VLLM_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")


def _validate(cfg: RollplexGRPOConfig) -> None:
    if cfg.rollplex_share_prefix not in ("auto", "on", "off"):
        raise ValueError(f"rollplex_share_prefix must be 'auto', 'on' or 'off', got {cfg.rollplex_share_prefix!r}")
    if cfg.rollplex_overlap not in ("auto", "on", "off"):
        raise ValueError(f"rollplex_overlap must be 'auto', 'on' or 'off', got {cfg.rollplex_overlap!r}")
    if cfg.rollplex_overlap_threads < 0 or cfg.rollplex_overlap_timeout_s <= 0:
        raise ValueError("rollplex_overlap_threads must be >= 0 and rollplex_overlap_timeout_s > 0, got "
                         f"{cfg.rollplex_overlap_threads} and {cfg.rollplex_overlap_timeout_s}")
    if cfg.rollplex_vllm_dtype not in _VLLM_DTYPES:
        raise ValueError(f"rollplex_vllm_dtype must be one of {_VLLM_DTYPES}, got {cfg.rollplex_vllm_dtype!r}")
    if cfg.rollplex_prefix_chunk_prompts < 1:
        raise ValueError(f"rollplex_prefix_chunk_prompts must be >= 1, got {cfg.rollplex_prefix_chunk_prompts}")
    if cfg.rollplex_video_fps <= 0:
        raise ValueError(f"rollplex_video_fps must be > 0, got {cfg.rollplex_video_fps}")
    if not 1 <= cfg.rollplex_video_min_frames <= cfg.rollplex_video_max_frames:
        raise ValueError(
            "need 1 <= rollplex_video_min_frames <= rollplex_video_max_frames, got "
            f"{cfg.rollplex_video_min_frames} and {cfg.rollplex_video_max_frames}"
        )
    if not 0 < cfg.rollplex_video_min_pixels <= cfg.rollplex_video_max_pixels:
        raise ValueError(
            "need 0 < rollplex_video_min_pixels <= rollplex_video_max_pixels, got "
            f"{cfg.rollplex_video_min_pixels} and {cfg.rollplex_video_max_pixels}"
        )
    if cfg.rollplex_max_prompt_length is not None and cfg.rollplex_max_prompt_length <= 0:
        raise ValueError(f"rollplex_max_prompt_length must be positive or None, got {cfg.rollplex_max_prompt_length}")
    if cfg.rollplex_media_cache_size < 0:
        raise ValueError(f"rollplex_media_cache_size must be >= 0, got {cfg.rollplex_media_cache_size}")

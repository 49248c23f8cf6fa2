"""Local checkpoints for tests, examples and benchmarks, built without any model hub.

Each builder writes a *real* checkpoint with ``save_pretrained`` (config, random weights, a byte-level BPE
tokenizer trained with ``tokenizers`` that carries Qwen's special tokens, Qwen2.5-VL's chat template and, for a
vision-language family, that family's processor with image and video processors), so that everything downstream
goes through the same ``from_pretrained`` code paths a user's Qwen checkpoint would. The vision-language builders
live in each family's adapter (models/qwen2_5_vl.py, models/qwen3_vl.py), the presets (``tiny``, ``demo``,
``small``, ``3b``) and the tokenizer in testing/tiny.py; this module holds the text model's builder, the dispatch by
kind and the cache.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import torch

from rollplex_trl.models.families import FAMILIES
from rollplex_trl.testing.tiny import (  # noqa: F401 (re-exported: tests and benchmarks import them from here)
    ENDOFTEXT,
    IM_END,
    IM_START,
    IMAGE_PAD,
    PRESETS,
    QWEN2_5_VL_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    Preset,
    TextPreset,
    VisionPreset,
    build_tokenizer,
    save_model,
    special_token_ids,
    text_config_kwargs,
)

logger = logging.getLogger(__name__)

# Bump when the builders change in a way that changes what they write: cached checkpoints are keyed by it.
BUILDER_VERSION = 5

# a model type, or a registered family's name ("qwen3-vl" = "qwen3_vl")
ModelKind = Literal["qwen2_5_vl", "qwen2", "qwen3_vl", "qwen2.5-vl", "qwen3-vl"]

# ----------------------------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------------------------

def _build_qwen2(out_dir: Path, preset: Preset, seed: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(preset.text.vocab_size)
    config = Qwen2Config(**text_config_kwargs(preset.text, tokenizer, with_mrope=False))
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    save_model(model, tokenizer, out_dir)
    tokenizer.save_pretrained(out_dir)


def _builders() -> dict:
    """The text model's builder and each registered vision-language family's (models/families.py), by model type."""
    return {"qwen2": _build_qwen2, **{f.model_type: f.build_checkpoint for f in FAMILIES.values()}}


def _model_type(kind: str) -> str:
    """A family's user-facing name ("qwen3-vl") is accepted wherever a model type ("qwen3_vl") is."""
    return FAMILIES[kind].model_type if kind in FAMILIES else kind


def build_checkpoint(out_dir: str | os.PathLike, kind: ModelKind = "qwen2_5_vl", preset: str = "tiny",
                     seed: int = 0) -> Path:
    """Write a checkpoint of ``kind`` and ``preset`` to ``out_dir`` (overwriting it) and return the path."""
    builders = _builders()
    kind = _model_type(kind)
    if kind not in builders:
        raise ValueError(f"unknown checkpoint kind {kind!r}; choose one of {sorted(builders)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    builders[kind](out, PRESETS[preset], seed)
    (out / "rollplex_checkpoint.json").write_text(
        json.dumps({"kind": kind, "preset": preset, "seed": seed, "builder_version": BUILDER_VERSION}, indent=2)
    )
    return out


def default_cache_dir() -> Path:
    """Where built checkpoints are cached: ``$ROLLPLEX_CACHE`` or ``~/.cache/rollplex_trl``."""
    return Path(os.environ.get("ROLLPLEX_CACHE", Path.home() / ".cache" / "rollplex_trl"))


def get_checkpoint(kind: ModelKind = "qwen2_5_vl", preset: str = "tiny", seed: int = 0,
                   cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the path of a cached local checkpoint, building it on first use.

    The build goes to a temporary directory that is renamed into place, so concurrent test processes and an
    interrupted build never leave a half-written checkpoint behind.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    kind = _model_type(kind)
    target = root / "checkpoints" / f"{kind}-{preset}-seed{seed}-v{BUILDER_VERSION}"
    if (target / "rollplex_checkpoint.json").exists():
        return target
    root.joinpath("checkpoints").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build_checkpoint(tmp, kind=kind, preset=preset, seed=seed)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race; its checkpoint is identical
            if not (target / "rollplex_checkpoint.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built %s checkpoint %s at %s", kind, preset, target)
    return target

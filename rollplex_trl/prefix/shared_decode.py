"""Shared-prefix decoding for transformers' `generate`: the prompt's K/V held once per group, not once per row.

`generate_with_shared_prefill` (generation.py) prefills each unique prompt once. Without this module it then copies
the prompt's K/V to the R = U*G rows, and every decode step reads the whole prompt once per completion. Here HF's
`generate` stays the loop (sampling, logits processors, stopping criteria, EOS handling and TRL's post-processing
unchanged); only two things are swapped for the duration of the call:

- the cache: `SharedPrefixCache`, whose layers hold the U prompts' K/V, a row -> prompt index, and each row's own
  K/V (its last prompt token and completion so far) in a preallocated buffer. To HF it looks like a cache of
  `prompt width - 1 + suffix` positions, so HF's input slicing, positions (M-RoPE `rope_deltas` included) and 2-D
  attention mask are exactly those of the expanded cache;
- the attention function: the text config's `_attn_implementation` is switched to a registered wrapper of the model's
  own (`sdpa` or `eager`). When the keys it receives are the suffix buffer of the active `SharedPrefixCache` layer,
  it runs `cascade_attention` (prefix part: one matmul per prompt for its G rows; suffix part per row; exact
  log-sum-exp merge). Any other call (another thread, e.g. the overlap's prefix jobs on the same model during the
  decode window, or a forward with another cache) goes to the original function with the original mask, unchanged.

Masks: HF builds its usual mask over `prompt width - 1 + suffix` columns. The prefix part uses the prompt's own
padding mask (one per prompt; the prompt's left padding stays masked), the suffix part HF's mask columns past the
prompt (causality and anything HF masks there).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rollplex_trl import trl_compat
from rollplex_trl.notices import notice
from rollplex_trl.prefix.cascade import RowGroups, cascade_attention, group_rows

SUPPORTED_ATTENTION = ("sdpa", "eager")
# "auto" decodes with the shared prefix from this many completions per prompt on. Measured on CPU
# (benchmarks/results/shared_decode*.json): 1.2-1.5x faster per decode step at G >= 8 with a 576-token
# video prompt (1.1x at G = 4), 0.96-1.07x with a 192-token one, but 0.90-0.95x there at G = 4. It depends only on
# G (the trainer passes num_generations), so every rank decides alike.
AUTO_MIN_GENERATIONS = 8
_NAME = "rollplex_cascade_{}"  # registered attention implementation per base implementation
_ACTIVE = threading.local()  # the SharedPrefixCache the current thread's generate decodes with
_LOGGED: set[str] = set()


# ----------------------------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------------------------


class SharedPrefixLayer(trl_compat.CacheLayerMixin):
    """One decoder layer's cache: the U prompts' K/V (read-only) and a growing, preallocated per-row suffix.

    `offset` is how many positions HF believes the prompt part has (the batch's prompt width - 1); the stored prompt
    K/V may be narrower (all-padding columns dropped), their mask says which of their columns are real.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, prefix_k: torch.Tensor, prefix_v: torch.Tensor, prefix_mask: torch.Tensor,
                 row_to_prompt: torch.Tensor, groups: RowGroups, offset: int, capacity: int):
        super().__init__()
        self.prefix_k, self.prefix_v = prefix_k, prefix_v  # (U, Hkv, Pc, D)
        self.prefix_mask = prefix_mask.bool()  # (U, Pc)
        self.row_to_prompt, self.groups = row_to_prompt, groups  # (R,), and where each prompt's rows are
        self.offset, self.capacity = offset, max(1, capacity)
        self.length = 0  # suffix positions stored
        self.device = prefix_k.device
        self.is_initialized = True
        self.served: tuple[torch.Tensor, torch.Tensor] | None = None  # what the last update returned
        self._prefix_cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        # The suffix buffers, allocated now rather than at the first update: every decode step then runs the same
        # code (a compiled decode step, prefix/compiled_decode.py, needs no separate graph for the first one)
        R = row_to_prompt.numel()
        self.keys = prefix_k.new_empty(R, prefix_k.size(1), self.capacity, prefix_k.size(-1))
        self.values = prefix_v.new_empty(R, prefix_v.size(1), self.capacity, prefix_v.size(-1))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("SharedPrefixLayer allocates its suffix buffers at construction")

    def _grow(self, needed: int) -> None:
        # Only if generate runs past the expected length (a caller's max_length above max_new_tokens): double
        self.capacity = max(needed, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], self.capacity, old.size(-1))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.dtype != self.keys.dtype or value_states.dtype != self.values.dtype:
            # the prompt's K/V were computed in another dtype than the decode's (a changed autocast): refuse
            # rather than round the completion's K/V to the prompt's dtype
            raise RuntimeError(f"shared-prefix decoding: decode K/V in {key_states.dtype}/{value_states.dtype}, "
                               f"the prompt's in {self.keys.dtype}/{self.values.dtype}; "
                               "set rollplex_shared_decode='off'")
        n = key_states.size(-2)
        if self.length + n > self.capacity:
            self._grow(self.length + n)
        self.keys[:, :, self.length: self.length + n] = key_states
        self.values[:, :, self.length: self.length + n] = value_states
        self.length += n
        self.served = (self.keys[:, :, : self.length], self.values[:, :, : self.length])
        return self.served

    def prefix_as(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's K/V in the attention's dtype, cast once per decode rather than at every step (under
        autocast the model's own SDPA would cast the whole cache at every step: the same values)."""
        if self.prefix_k.dtype == dtype and self.prefix_v.dtype == dtype:
            return self.prefix_k, self.prefix_v
        if dtype not in self._prefix_cast:
            self._prefix_cast[dtype] = (self.prefix_k.to(dtype), self.prefix_v.to(dtype))
        return self._prefix_cast[dtype]

    def get_seq_length(self) -> int:
        return self.offset + self.length

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` suffix positions (DynamicLayer's convention: a negative count)."""
        if tokens_to_remove > 0 or -tokens_to_remove > self.length:
            raise ValueError(f"cannot crop {tokens_to_remove} positions from a suffix of {self.length}")
        self.length += tokens_to_remove

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.offset + self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def kv_bytes(self) -> int:
        """Bytes held: the prompt K/V once per prompt, plus the suffix buffers."""
        tensors = [self.prefix_k, self.prefix_v, self.keys, self.values]
        return sum(t.numel() * t.element_size() for t in tensors)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("shared-prefix decoding does not support beam search (falls back before this)")


class SharedPrefixCache(trl_compat.Cache):
    """A `Cache` of `SharedPrefixLayer`s, one per decoder layer."""

    def __init__(self, layers: list[SharedPrefixLayer]):
        super().__init__(layers=layers)

    def kv_bytes(self) -> int:
        return sum(layer.kv_bytes() for layer in self.layers)

    def check_used(self) -> None:
        """Fail loudly if a decoder layer never wrote to this cache: it then attended without the prompt (a
        transformers change, or a layer that drops caches under gradient checkpointing), and its tokens are wrong."""
        unused = [i for i, layer in enumerate(self.layers) if layer.length == 0]
        if unused:
            raise RuntimeError(f"shared-prefix decoding: decoder layers {unused} never used the prompt's cache; "
                               "set rollplex_shared_decode='off'")


def build_cache(keys: list[torch.Tensor], values: list[torch.Tensor], prefix_mask: torch.Tensor,
                row_to_prompt: torch.Tensor, offset: int, capacity: int) -> SharedPrefixCache:
    """The decode cache from a prefix state's per-layer K/V ((U, Hkv, Pc, D) each) and their (U, Pc) mask."""
    groups = group_rows(row_to_prompt, prefix_mask.size(0))  # once: it reads row counts on the host
    prefix_mask = prefix_mask.bool()
    return SharedPrefixCache([SharedPrefixLayer(k, v, prefix_mask, row_to_prompt, groups, offset, capacity)
                              for k, v in zip(keys, values)])


# ----------------------------------------------------------------------------------------------------------------
# The attention function
# ----------------------------------------------------------------------------------------------------------------


def base_attention(base: str, module: nn.Module):
    """The model's own attention function `base` ("sdpa" or "eager") for `module`."""
    if base == "sdpa":
        return sdpa_attention_forward
    # eager attention is defined per model file (same math everywhere; the model's own keeps its rounding)
    return sys.modules[type(module).__module__].eager_attention_forward


def _served_layer(module: nn.Module, key: torch.Tensor) -> SharedPrefixLayer | None:
    """The active cache's layer if `key` is exactly what it just served to this module, else None."""
    cache = getattr(_ACTIVE, "cache", None)
    layer_idx = getattr(module, "layer_idx", None)
    if cache is None or layer_idx is None or layer_idx >= len(cache.layers):
        return None
    layer = cache.layers[layer_idx]
    return layer if layer.served is not None and layer.served[0] is key else None


def _suffix_keep(attention_mask: torch.Tensor | None, offset: int, q_len: int, s_len: int) -> torch.Tensor | None:
    """Which suffix keys each query may see: HF's mask columns past the prompt (bool or additive 0/-inf), or, when
    HF skipped the mask (no padding: it relies on causality), the causal pattern aligned to the last key."""
    if attention_mask is None:
        if q_len == 1:
            return None
        q_pos = torch.arange(q_len).unsqueeze(1) + (s_len - q_len)
        return (torch.arange(s_len).unsqueeze(0) <= q_pos).view(1, 1, q_len, s_len)
    mask = attention_mask[..., offset: offset + s_len]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def attention_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.dtype:
    """The dtype the model's own attention computes in: under autocast, SDPA and matmul cast their inputs to the
    autocast dtype (the K cache is fp32 there: RoPE's fp32 cos/sin promote it; V is bf16), else the inputs'."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)


def _make_attention(base: str):
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
        layer = _served_layer(module, key)
        if layer is None:
            return base_attention(base, module)(module, query, key, value, attention_mask, dropout=dropout,
                                                 scaling=scaling, **kwargs)
        if dropout:
            raise RuntimeError("shared-prefix decoding with attention dropout (falls back before this)")
        keep = _suffix_keep(attention_mask, layer.offset, query.size(2), key.size(2))
        if keep is not None:
            keep = keep.to(query.device)
        scale = scaling if scaling is not None else query.size(-1) ** -0.5
        dtype = attention_dtype(query, key, value)
        prefix_k, prefix_v = layer.prefix_as(dtype)
        out = cascade_attention(query.to(dtype), prefix_k, prefix_v, layer.prefix_mask, layer.row_to_prompt,
                                key.to(dtype), value.to(dtype), keep, scale, groups=layer.groups)
        return out.transpose(1, 2).contiguous(), None

    return attention


def register_attention() -> None:
    """Register the cascade wrappers (idempotent): attention under `rollplex_cascade_<base>`, and the base's own
    mask function under the same name so HF builds exactly the mask the base implementation gets."""
    for base in ("sdpa", "eager"):
        trl_compat.register_attention(_NAME.format(base), _make_attention(base), mask_like=base)


# ----------------------------------------------------------------------------------------------------------------
# When it applies, and the switch around one generate call
# ----------------------------------------------------------------------------------------------------------------


def log_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        notice(f"shared-prefix decoding off, the expanded-cache path is used: {reason}")


def _attention_modules(causal_lm: nn.Module) -> list[nn.Module]:
    backbone = causal_lm.base_model
    layers = getattr(backbone, "language_model", backbone).layers
    return [getattr(layer, "self_attn", None) for layer in layers]


def auto_applies(num_generations: int) -> bool:
    """Whether `rollplex_shared_decode="auto"` wants shared-prefix decoding for groups of `num_generations`."""
    return num_generations >= AUTO_MIN_GENERATIONS


def unsupported_reason(causal_lm: nn.Module, generation_kwargs: dict) -> str | None:
    """Why shared-prefix decoding cannot run this `generate` call exactly, or None if it can."""
    config = generation_kwargs.get("generation_config") or getattr(causal_lm, "generation_config", None)

    def setting(name: str, default):
        value = generation_kwargs.get(name, getattr(config, name, default) if config is not None else default)
        return default if value is None else value

    text_config = causal_lm.config.get_text_config()
    implementation = trl_compat.attention_implementation(causal_lm)
    attention = _attention_modules(causal_lm)
    if setting("num_beams", 1) > 1:
        return "beam search (num_beams > 1)"
    if setting("num_return_sequences", 1) > 1:
        return "num_return_sequences > 1"
    if generation_kwargs.get("assistant_model") is not None or setting("prompt_lookup_num_tokens", None):
        return "assisted decoding"
    if not setting("use_cache", True):
        return "use_cache=False"
    if implementation not in SUPPORTED_ATTENTION:
        return f"attention implementation {implementation!r} (supported: {', '.join(SUPPORTED_ATTENTION)})"
    if any(t != "full_attention" for t in getattr(text_config, "layer_types", None) or []):
        return "sliding-window decoder layers"
    if not attention or any(a is None or getattr(a, "config", None) is not text_config
                            or not hasattr(a, "layer_idx") for a in attention):
        return f"{type(causal_lm).__name__}'s decoder layers lack the expected `self_attn` (config, layer_idx)"
    if causal_lm.training and getattr(text_config, "attention_dropout", 0.0):
        return "attention dropout in training mode"
    return None


def decoding_on_this_thread() -> bool:
    """Whether this thread is inside `decoding_with` (its forwards decode with a shared-prefix cache)."""
    return getattr(_ACTIVE, "cache", None) is not None


@contextlib.contextmanager
def decoding_with(causal_lm: nn.Module, cache: SharedPrefixCache) -> Iterator[None]:
    """Within the block, this thread's forwards of `causal_lm` with `cache` run cascade attention."""
    register_attention()
    base = trl_compat.attention_implementation(causal_lm)
    previous = getattr(_ACTIVE, "cache", None)
    _ACTIVE.cache = cache
    try:
        with trl_compat.attention_implementation_set(causal_lm, _NAME.format(base)):
            yield
    finally:
        _ACTIVE.cache = previous


def expected_suffix_length(causal_lm: nn.Module, generation_kwargs: dict, prompt_width: int) -> int:
    """Suffix positions the cache will hold: the last prompt token plus every fed-back token (for preallocation)."""
    config = generation_kwargs.get("generation_config") or getattr(causal_lm, "generation_config", None)
    new = generation_kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if new is None:
        max_length = generation_kwargs.get("max_length", getattr(config, "max_length", None)) or prompt_width + 20
        new = max(1, max_length - prompt_width)
    return int(new) + 1

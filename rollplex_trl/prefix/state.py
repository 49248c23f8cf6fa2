"""What one prefix forward leaves behind for the suffix passes: the prompts' per-layer keys and values.

Layout (U unique prompts, left-padded to length P, L decoder layers):

    prompt tokens   p_0 ... p_{P-2} | p_{P-1}          completion tokens c_0 ... c_{C-1}
                    '--- cached ---'  '-- re-run by every suffix pass, so that its hidden state (which
                     (keys/values)       predicts c_0) comes out of the same forward as the completion's'

Only prompt[:, :-1] is cached. The last prompt token is run again at the head of every suffix, which lets a
suffix pass score all C completion tokens with the usual causal shift (TRL's fused LM head works unchanged) instead
of keeping a hidden state around. Left padding puts that last real token at index P-1 in every row.

Memory per prompt, K and V of every layer: ``2 * L * kv_heads * head_dim * (P-1) * bytes_per_element``.
Qwen2.5-VL-7B in bf16 (28 layers, 4 KV heads, head_dim 128): 57 KB per prompt token, ~115 MB for a 2k-token video
prompt (the 3B model: ~37 KB per token). With ``has_graph`` the prompt's autograd graph is alive too: without
gradient checkpointing that is every activation of the prompt forward (vision tower included); with it, only
each decoder layer's input hidden state (``L * P * hidden * bytes``) plus the vision tower's checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class PrefixState:
    """Per-layer keys/values of U unique prompts (all but their last token), plus what a suffix pass needs."""

    keys: list[torch.Tensor]  # L x (U, kv_heads, P-1, head_dim), RoPE already applied
    values: list[torch.Tensor]  # L x (U, kv_heads, P-1, head_dim)
    prompt_mask: torch.Tensor  # (U, P) left-padded 0/1 mask of the whole prompt, last token included
    last_token_ids: torch.Tensor  # (U,) the last prompt token, the first token of every suffix
    last_positions: torch.Tensor  # (3, U) M-RoPE position of the last prompt token, or (U,) for 1-D RoPE models
    num_layers: int
    has_graph: bool  # whether keys/values carry the autograd graph of the prompt forward

    @property
    def num_prompts(self) -> int:
        return self.prompt_mask.size(0)

    @property
    def prompt_length(self) -> int:
        """P, the padded prompt length (the cache itself holds P-1 positions)."""
        return self.prompt_mask.size(1)

    @property
    def is_mrope(self) -> bool:
        return self.last_positions.dim() == 2

    def kv_bytes(self) -> int:
        """Bytes held by the cached keys and values (for all U prompts)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def kv_tensors(self) -> list[torch.Tensor]:
        """keys and values of all layers as one flat list: [k_0, v_0, k_1, v_1, ...]."""
        return [t for kv in zip(self.keys, self.values) for t in kv]

    def take(self, prompts: torch.Tensor) -> PrefixState:
        """The state of a subset of the prompts (differentiable `index_select` on the K/V)."""
        return replace(
            self, keys=[k.index_select(0, prompts) for k in self.keys],
            values=[v.index_select(0, prompts) for v in self.values], prompt_mask=self.prompt_mask[prompts],
            last_token_ids=self.last_token_ids[prompts], last_positions=self.last_positions.index_select(-1, prompts))

    def with_kv(self, tensors: list[torch.Tensor], has_graph: bool) -> PrefixState:
        """A copy holding `tensors` (in `kv_tensors()` order) in place of the keys and values."""
        return replace(self, keys=list(tensors[0::2]), values=list(tensors[1::2]), has_graph=has_graph)

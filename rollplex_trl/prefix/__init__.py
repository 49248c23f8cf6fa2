"""Shared-prefix log-probs for GRPO: each prompt runs once, its G completions run against its keys/values.

Exact against the full prompt+completion forward (log-probs, entropies and gradients, vision tower included).
"""

from rollplex_trl.prefix.forward import backward_prefix, detach_prefix, prefix_forward, suffix_logps, unwrap_model
from rollplex_trl.prefix.state import PrefixState

__all__ = ["PrefixState", "backward_prefix", "detach_prefix", "prefix_forward", "suffix_logps", "unwrap_model"]

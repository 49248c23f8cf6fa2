"""``rollplex_backend="megatron"``: the policy as megatron-core tensor-parallel layers (docs/megatron.md).

Importing this package checks the megatron-core version (rollplex_trl.megatron_compat) and raises ImportError with
the install hint when it is missing.
"""

import rollplex_trl.megatron_compat  # noqa: F401  version guard first
from rollplex_trl.backends.megatron.grads import (
    average_data_parallel_gradients,
    clip_grad_norm_tensor_parallel,
    share_replicated_gradients,
    sum_vision_gradients,
)
from rollplex_trl.backends.megatron.logprobs import vocab_parallel_logps
from rollplex_trl.backends.megatron.model import MegatronPolicy
from rollplex_trl.backends.megatron.parallel import ParallelGroups, init_model_parallel, release_model_parallel

__all__ = [
    "MegatronPolicy",
    "ParallelGroups",
    "average_data_parallel_gradients",
    "clip_grad_norm_tensor_parallel",
    "init_model_parallel",
    "release_model_parallel",
    "share_replicated_gradients",
    "sum_vision_gradients",
    "vocab_parallel_logps",
]

"""`HfBackend`: the transformers model TRL built trains itself (`rollplex_backend="hf"`, the default).

Everything TRL already does right is left to TRL (the methods return None: the trainer calls GRPOTrainer's own);
what this backend adds is the shared-prefix log-prob passes on the transformers model (prefix/batch.py) and the
rollout's frozen-weight casts (rollout/weight_casts.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.data import Sampler

from rollplex_trl.data.prompt import PreparedPrompt
from rollplex_trl.prefix import suffix_logps
from rollplex_trl.prefix.batch import prepared_rows_logps, run_prefix, shared_prefix_logps
from rollplex_trl.prefix.generation import BackendPrefill
from rollplex_trl.prefix.state import PrefixState
from rollplex_trl.prefix.suffix_attention import unsupported_reason
from rollplex_trl.rollout.weight_casts import frozen_weight_casts_kept


class HfBackend:
    name = "hf"

    def __init__(self, unwrap: Callable[[nn.Module], nn.Module]) -> None:
        self.unwrap = unwrap  # accelerate's unwrap_model: DDP's wrapper off
        self.suffix_attention_mode = "concat"  # the run plan's `suffix_attention`, set by the trainer

    # ---- models ------------------------------------------------------------------------------------------------
    def trained_model(self, model: nn.Module) -> nn.Module:
        return self.unwrap(model)

    def prefix_job_models(self, policy: nn.Module, ref: nn.Module | None, *, training: bool
                          ) -> tuple[nn.Module, nn.Module | None, dict[str, Any]]:
        return policy, ref, {}

    def window_weights(self) -> list[torch.Tensor]:
        return []

    def build_actor_prefix(self) -> Callable[..., PrefixState]:
        return run_prefix  # the transformers prefix pass

    def cascade_unsupported(self, causal_lm: nn.Module, device: torch.device) -> str | None:
        return unsupported_reason(causal_lm, device)

    # ---- rollout -----------------------------------------------------------------------------------------------
    def generate(self, rollout, peer) -> tuple[list[list[int]], Any]:
        return rollout(None)

    def rollout_prefill(self, *, training: bool) -> BackendPrefill | None:
        return None  # the decoding model prefills with its own layers

    def prefill_serves_actor(self, *, training: bool) -> bool:
        return True  # the model that prefills is the policy

    def decode_weight_casts(self, policy: nn.Module, *, concurrent_graph_job: bool, sharded: bool
                            ) -> AbstractContextManager:
        # DeepSpeed/FSDP own the parameters' storage; a concurrent job building a graph on the policy (the
        # overlap's actor job) would see frozen weights marked as requiring grad
        if sharded or concurrent_graph_job:
            return contextlib.nullcontext()
        return frozen_weight_casts_kept(policy)

    # ---- log-probs ---------------------------------------------------------------------------------------------
    def actor_suffix_logps(self, policy: nn.Module, state: PrefixState, row_to_prompt: torch.Tensor,
                           completion_ids: torch.Tensor, completion_mask: torch.Tensor, *, temperature: float,
                           compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return suffix_logps(policy, state, row_to_prompt, completion_ids, completion_mask, temperature=temperature,
                            compute_entropy=compute_entropy, attention=self.suffix_attention_mode)

    def logps_and_entropies(self, model: nn.Module, *, reference: bool, input_ids: torch.Tensor,
                            attention_mask: torch.Tensor, logits_to_keep: int, batch_size: int | None,
                            temperature: float, compute_entropy: bool, compute_aux_loss: bool,
                            rows: Sequence[PreparedPrompt] | None, vision_kwargs: dict[str, Any],
                            autocast: Callable[[], AbstractContextManager], training: bool, share_prefix: bool,
                            prompts_per_chunk: int, precomputed: Any
                            ) -> tuple[torch.Tensor, torch.Tensor | None, int | None] | None:
        if share_prefix:  # each prompt once per call, in one graph
            with autocast():
                return shared_prefix_logps(
                    self.unwrap(model), input_ids, attention_mask, logits_to_keep, rows, temperature=temperature,
                    compute_entropy=compute_entropy, prompts_per_chunk=prompts_per_chunk, precomputed=precomputed,
                    suffix_fn=functools.partial(suffix_logps, attention=self.suffix_attention_mode))
        if rows is None:
            return None  # TRL's own pass
        logps, entropies, _ = prepared_rows_logps(model, rows, input_ids, attention_mask, logits_to_keep, batch_size,
                                                  compute_entropy, compute_aux_loss, autocast)
        return logps, entropies, None

    # ---- optimizer and state: transformers' own ------------------------------------------------------------------
    def create_optimizer(self, args: Any) -> None:
        return None

    def clip_grad_norm(self, max_norm: float | None) -> None:
        return None

    def sync_rollout(self) -> None:
        pass  # the trained model is the one that decodes and is saved

    def after_checkpoint_load(self, model: nn.Module) -> None:
        pass

    def save_optimizer_state(self, optimizer: torch.optim.Optimizer, folder: str) -> None:
        pass

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, folder: str) -> None:
        pass

    def wrap_sampler(self, sampler: Sampler, loader_batch_size: int, *, generation_batches: bool) -> Sampler:
        return sampler

    def close(self) -> None:
        pass

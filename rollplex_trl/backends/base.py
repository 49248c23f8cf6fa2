"""`TrainingBackend`: what the trainer asks of the engine that holds and trains the policy.

The trainer (trainers/grpo.py) is the schedule of one step; everything that depends on *which* engine trains the
policy goes through this interface, so the trainer never branches on the backend. Two implementations:

    hf        backends/hf.py               the transformers model TRL built (DDP through accelerate)
    megatron  backends/megatron/backend.py a Megatron-Core TP copy of the LLM + the HF vision tower

A method that returns None means "TRL's own code does this" (the trainer then calls GRPOTrainer's method): the `hf`
backend returns None wherever TRL's path is already right, so a text batch on the `hf` backend runs TRL's code
unchanged. A new backend passes tests/backends/test_contract.py (ref/old/actor log-probs, entropies and the grad
norm against an independent full forward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import Sampler

from rollplex_trl.data.prompt import PreparedPrompt
from rollplex_trl.prefix.generation import BackendPrefill
from rollplex_trl.prefix.state import PrefixState

# rollout(pool) -> (completion ids, sampling log-probs); peer(pool) runs a pooled rollout's non-decoding side
Rollout = Callable[[Any], tuple[list[list[int]], Any]]
PeerRollout = Callable[[Any], None]


class TrainingBackend(Protocol):
    name: str
    suffix_attention_mode: str  # "cascade" | "concat": the run plan's choice, set by the trainer

    # ---- models ------------------------------------------------------------------------------------------------
    def trained_model(self, model: nn.Module) -> nn.Module:
        """The module the actor's passes run (the unwrapped policy, or the backend's own copy)."""

    def prefix_job_models(self, policy: nn.Module, ref: nn.Module | None, *, training: bool
                          ) -> tuple[nn.Module, nn.Module | None, dict[str, Any]]:
        """The models the decode window's prefix jobs run, and extra `PrefixJobs` fields (a backend's own
        `precompute`)."""

    def window_weights(self) -> list[torch.Tensor]:
        """Weights the window's jobs read besides the transformers policy and reference (checked unchanged)."""

    def build_actor_prefix(self) -> Callable[..., PrefixState]:
        """How the actor window builds its prefix (`ActorWindow(build_prefix=)`, `run_prefix`'s signature)."""

    def cascade_unsupported(self, causal_lm: nn.Module, device: torch.device) -> str | None:
        """Why the cascade suffix attention cannot run this model on this backend (None: it can). A fact for the
        run plan (trainers/plan.py), which decides; the decision comes back as `suffix_attention_mode`."""

    # ---- rollout -----------------------------------------------------------------------------------------------
    def generate(self, rollout: Rollout, peer: PeerRollout) -> tuple[list[list[int]], Any]:
        """Run the rollout at the current weights: `rollout(pool)` where this rank decodes, `peer(pool)` where it
        only joins a pooled rollout's collectives; the completions every rank of the step then shares."""

    def rollout_prefill(self, *, training: bool) -> BackendPrefill | None:
        """The shared prefill's prefix pass, or None for the decoding model's own layers."""

    def prefill_serves_actor(self, *, training: bool) -> bool:
        """Whether the rollout's prefill is the actor's prefix (the same model and pass)."""

    def decode_weight_casts(self, policy: nn.Module, *, concurrent_graph_job: bool, sharded: bool
                            ) -> AbstractContextManager:
        """Entered around the decode steps under autocast: casts of frozen weights kept for one generate call."""

    # ---- log-probs ---------------------------------------------------------------------------------------------
    def actor_suffix_logps(self, policy: nn.Module, state: PrefixState, row_to_prompt: torch.Tensor,
                           completion_ids: torch.Tensor, completion_mask: torch.Tensor, *, temperature: float,
                           compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss pass inside an accumulation window: completions against the window's prefix."""

    def logps_and_entropies(self, model: nn.Module, *, reference: bool, input_ids: torch.Tensor,
                            attention_mask: torch.Tensor, logits_to_keep: int, batch_size: int | None,
                            temperature: float, compute_entropy: bool, compute_aux_loss: bool,
                            rows: Sequence[PreparedPrompt] | None, vision_kwargs: dict[str, Any],
                            autocast: Callable[[], AbstractContextManager], training: bool, share_prefix: bool,
                            prompts_per_chunk: int, precomputed: Any
                            ) -> tuple[torch.Tensor, torch.Tensor | None, int | None] | None:
        """Per-token log-probs, entropies and the number of unique prompts (None: not shared) of any other pass
        (reference, old, actor outside a window); None: TRL's own pass."""

    # ---- optimizer ---------------------------------------------------------------------------------------------
    def create_optimizer(self, args: Any) -> torch.optim.Optimizer | None:
        """The optimizer over the backend's trainable parameters; None: transformers builds it."""

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor | None:
        """The gradients' global norm, clipped to `max_norm` (None: not clipped); None: transformers does it."""

    # ---- state -------------------------------------------------------------------------------------------------
    def sync_rollout(self) -> None:
        """Bring the transformers model (what is saved and decodes) to the trained weights."""

    def after_checkpoint_load(self, model: nn.Module) -> None:
        """The loaded transformers weights become the training weights."""

    def save_optimizer_state(self, optimizer: torch.optim.Optimizer, folder: str) -> None:
        """What transformers' optimizer checkpoint does not hold (other ranks' shards)."""

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, folder: str) -> None:
        ...

    def wrap_sampler(self, sampler: Sampler, loader_batch_size: int, *, generation_batches: bool) -> Sampler:
        """The sampler every rank of the backend's data-parallel replica reads (TP ranks: the same rows)."""

    def close(self) -> None:
        """Release process groups and other resources held beyond the training run."""

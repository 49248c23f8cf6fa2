"""The rollout engine interface shared by the transformers engine and the vLLM engines.

A rollout is a list of `RolloutRequest`s, one per *unique* prompt, each asking for `n` samples (GRPO's G). TRL's
colocate path sends every prompt G times with n = 1, which makes vLLM prefill it G times; one request with n = G
prefills once and forks. Results come back in request order, each with its n samples, and every sample carries the
per-token log-probs of the sampling distribution (after temperature and logit processing), which TRL's importance-
sampling correction compares with the trainer's log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class RolloutRequest:
    prompt_ids: list[int]
    n: int = 1
    # vLLM's multi_modal_data ({"image": [...], "video": [(frames, metadata), ...]}), built by rollout/requests.py
    multi_modal_data: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


@dataclass
class RolloutSample:
    completion_ids: list[int]
    logprobs: list[float] | None = None  # one per completion token, of the distribution it was sampled from


@dataclass
class SamplingSpec:
    """TRL's sampling options (GRPOConfig names), translated by each engine."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs_regex: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # GRPOConfig.generation_kwargs


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout backend."""

    def generate(self, requests: list[RolloutRequest], sampling: SamplingSpec) -> list[list[RolloutSample]]:
        """Samples for each request, in request order (each list has `request.n` samples)."""

    def sync_weights(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Make the engine's weights equal to `model`'s (a no-op where the engine *is* the model); returns metrics
        (`rollplex/weight_sync_s`, `rollplex/weight_sync_bytes`). `version` identifies the trainer's weights (the
        optimizer step): an engine that already holds `version` and has not discarded its weights does nothing."""

    def sleep(self) -> None:
        """Release rollout-only memory (the KV cache, and weights per the sharing mode) while the trainer trains."""

    def wake(self) -> None:
        """Undo `sleep` before the next rollout."""


def flatten_rows(results: list[list[RolloutSample]]) -> tuple[list[list[int]], list[list[float]] | None]:
    """Per-row completion ids and log-probs in TRL's row order (the n samples of request i are rows i*n ... i*n+n-1)."""
    ids = [s.completion_ids for samples in results for s in samples]
    logprobs = [s.logprobs for samples in results for s in samples]
    if any(lp is None for lp in logprobs):
        return ids, None
    return ids, logprobs  # type: ignore[return-value]

"""The batch in flight: what one TRL override hands the next, in one explicit object instead of loose attributes.

TRL's call chain for a generation batch is `_generate_and_score_completions` -> `_tokenize_prompts` ->
`_generate_single_turn` -> (rewards) -> `_get_per_token_logps_and_entropies` (old, ref); for a micro-batch it is
`compute_loss` -> `_get_per_token_logps_and_entropies` (actor). None of these pass our per-row prepared prompts
along, so the trainer sets them here for the duration of the outer call and the inner override reads them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rollplex_trl.data.prompt import PreparedPrompt
from rollplex_trl.prefix.batch import ActorPrefix, StepPrefixes
from rollplex_trl.prefix.vision_reuse import VideoFeatureStore


@dataclass
class BatchContext:
    """Per-batch state, set only inside the calls that own it (None outside)."""

    generation_rows: list[PreparedPrompt] | None = None  # the generation batch being tokenized and sampled
    scored_rows: list[PreparedPrompt] | None = None  # one prepared prompt per row of the log-prob pass running now
    actor: tuple[ActorPrefix, torch.Tensor] | None = None  # the loss pass: window prefix and each row's prompt
    # the prefix states the latest rollout built (decode window, kept prefill); replaced by each rollout, read by
    # the scoring passes and, after the generation batch, by the actor window's first micro-batch
    prefixes: StepPrefixes = field(default_factory=StepPrefixes)
    # T-GRPO: the shuffled completions of this generation batch (trainers/temporal.py), from the rollout to the rewards
    shuffled: Any = None
    # T-GRPO at temporal-patch granularity: the video features the ordered rollout's prefill computed, for the
    # shuffled copies' prefill (prefix/vision_reuse.py); None when nothing reuses them
    video_store: VideoFeatureStore | None = None
    # the exactness audit: the transformers sampler's log-probs of the audited rows (rollout/sampled_logps.py), from
    # the rollout to `audit_sampler`, which takes them (`take_sampler_logps`)
    sampler_logps: torch.Tensor | None = None


    @contextlib.contextmanager
    def generating(self, rows: list[PreparedPrompt]) -> Iterator[None]:
        previous = self.generation_rows, self.scored_rows
        self.generation_rows = self.scored_rows = rows
        self.shuffled = self.video_store = self.sampler_logps = None
        try:
            yield
        finally:
            self.generation_rows, self.scored_rows = previous
            self.shuffled = self.video_store = None

    def take_sampler_logps(self) -> torch.Tensor | None:
        value, self.sampler_logps = self.sampler_logps, None
        return value

    @contextlib.contextmanager
    def scoring(self, rows: list[PreparedPrompt] | None,
                actor: tuple[ActorPrefix, torch.Tensor] | None = None) -> Iterator[None]:
        previous = self.scored_rows, self.actor
        self.scored_rows, self.actor = rows, actor
        try:
            yield
        finally:
            self.scored_rows, self.actor = previous

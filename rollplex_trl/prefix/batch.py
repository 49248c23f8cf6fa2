"""From TRL's batches (rows = completions, prompt repeated G times) to prefix/suffix passes over unique prompts.

TRL's log-prob passes see `input_ids = cat(prompt_ids, completion_ids)` for R rows. Here the rows are grouped by
prompt: a row's prompt is identified by its `PreparedPrompt` (video/image prompts: same tokens can carry different
pixels) or, for text-only prompts, by its tokens. Each unique prompt runs once through `prefix_forward`; every row
runs only [last prompt token, completion] through `suffix_logps`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal

import torch

from rollplex_trl.data.prompt import PreparedPrompt, prompt_identity, token_type_ids, vision_inputs
from rollplex_trl.prefix.forward import prefix_forward, suffix_logps, unwrap_model
from rollplex_trl.prefix.state import PrefixState
from rollplex_trl.prefix.vision_reuse import VideoFeatureStore


@dataclass
class PromptGroups:
    """Which row continues which unique prompt."""

    keys: list[object]  # one hashable key per unique prompt, in first-appearance order
    first_row: list[int]  # a row holding each unique prompt
    row_to_prompt: torch.Tensor  # (R,) index into `keys`


def prompt_key(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, row: PreparedPrompt | None) -> object:
    """What makes two rows share a prefix: `prompt_identity` of the row's unpadded prompt (data/prompt.py)."""
    return prompt_identity(() if row is not None else prompt_ids[prompt_mask.bool()].tolist(), row)


def group_by_prompt(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                    rows: Sequence[PreparedPrompt] | None) -> PromptGroups:
    index: dict[object, int] = {}
    first_row: list[int] = []
    row_to_prompt = []
    for r in range(prompt_ids.size(0)):
        key = prompt_key(prompt_ids[r], prompt_mask[r], rows[r] if rows is not None else None)
        if key not in index:
            index[key] = len(first_row)
            first_row.append(r)
        row_to_prompt.append(index[key])
    return PromptGroups(keys=list(index), first_row=first_row,
                        row_to_prompt=torch.tensor(row_to_prompt, dtype=torch.long, device=prompt_ids.device))


def prefix_inputs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: Sequence[PreparedPrompt] | None, *,
                  trim: bool = True) -> tuple[int, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The prefix pass's inputs for U unique left-padded prompts: the number of all-padding columns dropped on the
    left (when `trim`), the trimmed ids and mask, and the rows' vision inputs with their `mm_token_type_ids`."""
    keep = prompt_mask.bool().any(0)
    start = int(keep.nonzero()[0]) if keep.any() and trim else 0
    prompt_ids, prompt_mask = prompt_ids[:, start:], prompt_mask[:, start:]
    vision: dict[str, torch.Tensor] = {}
    if rows is not None:
        vision = vision_inputs(list(rows), prompt_ids.device)
        if vision:
            P = prompt_ids.size(1)
            vision["mm_token_type_ids"] = token_type_ids(list(rows), P, P, prompt_ids.device)
    return start, prompt_ids, prompt_mask, vision


def run_prefix(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               rows: Sequence[PreparedPrompt] | None, *, keep_graph: bool, generate_positions: bool = False,
               trim: bool = True, video_store: VideoFeatureStore | None = None) -> PrefixState:
    """`prefix_forward` on U unique prompts, given as left-padded rows (U, P) and, for VL prompts, their
    `PreparedPrompt`s. Columns that are padding in every row are dropped first (they cost compute, change nothing).
    `generate_positions`: 1-D RoPE positions as HF's `generate` numbers them (from each row's first real token)
    instead of as its plain forward does (arange), so a cache built here continues `generate` exactly.
    `video_store`: the step's recorded video features (prefix/vision_reuse.py), reused and extended here."""
    start, prompt_ids, prompt_mask, vision = prefix_inputs(prompt_ids, prompt_mask, rows, trim=trim)
    positions = None
    if generate_positions and not hasattr(unwrap_model(model).base_model, "get_rope_index"):
        positions = (prompt_mask.long().cumsum(-1) - 1).masked_fill(prompt_mask == 0, 1)
    features = video_store.for_rows(rows) if video_store is not None and rows is not None else None
    return prefix_forward(model, prompt_ids, prompt_mask, keep_graph=keep_graph, position_ids=positions,
                          video_features=features, **vision)


def shared_prefix_logps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        logits_to_keep: int, rows: Sequence[PreparedPrompt] | None, *, temperature: float,
                        compute_entropy: bool, prompts_per_chunk: int, precomputed: Precomputed | None = None,
                        prefix_fn: Callable[..., PrefixState] | None = None,
                        suffix_fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Per-token log-probs (R, C) of TRL's batch (and entropies, and the number of unique prompts), each unique
    prompt's prefix computed once. `precomputed` holds prefix states built earlier (in the rollout's decode window)
    for exactly these prompts; then only the suffixes run here. `prefix_fn`/`suffix_fn` default to the transformers
    passes (`run_prefix`, `suffix_logps`); the Megatron backend passes its own with the same signatures.

    Runs under whatever grad mode the caller set, with each chunk's prefix and suffixes in one graph (no-grad passes
    and evaluation). `prompts_per_chunk` bounds how many unique prompts (with all their rows) run at once.
    """
    P = input_ids.size(1) - logits_to_keep
    prompt_ids, prompt_mask = input_ids[:, :P], attention_mask[:, :P]
    completion_ids, completion_mask = input_ids[:, P:], attention_mask[:, P:]
    groups = group_by_prompt(prompt_ids, prompt_mask, rows)
    if precomputed is not None and not precomputed.matches(groups.keys):
        precomputed = None  # built for other prompts (cannot happen in the trainer's order): compute here instead
    chunk_rows, chunk_logps, chunk_entropies = [], [], []
    U = len(groups.keys)
    for start in range(0, U, max(1, prompts_per_chunk)):
        stop = min(U, start + max(1, prompts_per_chunk))
        first = [groups.first_row[u] for u in range(start, stop)]
        if precomputed is not None:
            state = precomputed.state.take(torch.arange(start, stop, device=prompt_ids.device))
        else:
            state = (prefix_fn or run_prefix)(model, prompt_ids[first], prompt_mask[first],
                                              [rows[r] for r in first] if rows is not None else None,
                                              keep_graph=torch.is_grad_enabled())
        row_idx = torch.nonzero((groups.row_to_prompt >= start) & (groups.row_to_prompt < stop))[:, 0]
        lp, ent = (suffix_fn or suffix_logps)(model, state, groups.row_to_prompt[row_idx] - start,
                                              completion_ids[row_idx], completion_mask[row_idx],
                                              temperature=temperature, compute_entropy=compute_entropy)
        chunk_rows.append(row_idx)
        chunk_logps.append(lp)
        chunk_entropies.append(ent)
    # Chunks hold the rows grouped by prompt; put them back in the batch's row order (differentiably).
    order = torch.cat(chunk_rows)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    logps = torch.cat(chunk_logps)[inverse]
    entropies = torch.cat(chunk_entropies)[inverse] if compute_entropy else None
    return logps, entropies, U


@dataclass
class Precomputed:
    """A prefix state computed ahead of its use (in the decode window), with the prompt keys it was built for."""

    keys: list[object]
    state: PrefixState

    def matches(self, keys: list[object]) -> bool:
        return keys == self.keys


PrefixKind = Literal["ref", "old", "actor"]
PREFIX_KINDS: tuple[PrefixKind, ...] = ("ref", "old", "actor")


@dataclass
class StepPrefixes:
    """The prefix states one rollout built for its generation batch, each taken once by the pass it is for.

    Filled during the rollout (the decode window's jobs; the prefill kept for the actor window), read by the
    reference and old log-prob passes and by the actor window's first micro-batch. A new one per rollout: a state
    never serves another generation batch."""

    ref: Precomputed | None = None  # the reference model's prefix (no graph)
    old: Precomputed | None = None  # the policy's prefix at θ_k for the old log-probs (no graph)
    actor: Precomputed | None = None  # the policy's prefix with its autograd graph, for the loss

    def put(self, kind: PrefixKind, state: Precomputed) -> None:
        if kind not in PREFIX_KINDS:
            raise ValueError(f"unknown prefix kind {kind!r} (one of {PREFIX_KINDS})")
        setattr(self, kind, state)

    def take_scoring(self, *, reference: bool) -> Precomputed | None:
        """The reference's (or the old policy's) state, once."""
        kind: PrefixKind = "ref" if reference else "old"
        state = getattr(self, kind)
        setattr(self, kind, None)
        return state

    def take_actor(self) -> Precomputed | None:
        state, self.actor = self.actor, None
        return state


def precompute_prefix(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      rows: Sequence[PreparedPrompt] | None, *, keep_graph: bool, prompts_per_chunk: int
                      ) -> Precomputed:
    """Prefix states of the unique prompts of a batch (rows grouped as the scoring passes will group them), in
    chunks, concatenated at the batch's full prompt width so any subset can be taken later."""
    groups = group_by_prompt(prompt_ids, prompt_mask, rows)
    states = []
    for start in range(0, len(groups.keys), max(1, prompts_per_chunk)):
        first = groups.first_row[start:start + prompts_per_chunk]
        states.append(run_prefix(model, prompt_ids[first], prompt_mask[first],
                                 [rows[r] for r in first] if rows is not None else None, keep_graph=keep_graph,
                                 trim=False))
    state = states[0] if len(states) == 1 else states[0].__class__(
        keys=[torch.cat(ks) for ks in zip(*(s.keys for s in states))],
        values=[torch.cat(vs) for vs in zip(*(s.values for s in states))],
        prompt_mask=torch.cat([s.prompt_mask for s in states]),
        last_token_ids=torch.cat([s.last_token_ids for s in states]),
        last_positions=torch.cat([s.last_positions for s in states], dim=-1),
        num_layers=states[0].num_layers, has_graph=any(s.has_graph for s in states))
    return Precomputed(keys=groups.keys, state=state)


@dataclass
class ActorPrefix:
    """The policy's prefix for one gradient-accumulation window: built with its graph at the window's first
    micro-batch, served to every micro-batch's suffix through leaf copies, back-propagated once at the end."""

    window: int  # index of the gradient-accumulation window it belongs to
    key_to_prompt: dict[object, int]
    leaf_state: PrefixState  # K/V detached to leaves: suffix backwards accumulate into their .grad
    outputs: list[torch.Tensor]  # the graph-carrying K/V, for the single backward through the prefix
    rows: int = 0  # the completions it serves over the window (all its micro-batches), for the metrics


def rows_to_prompts(actor: ActorPrefix, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                    rows: Sequence[PreparedPrompt] | None) -> torch.Tensor:
    """Map a micro-batch's rows to the actor prefix's prompts; KeyError if some row's prompt is not there."""
    index = []
    for r in range(prompt_ids.size(0)):
        key = prompt_key(prompt_ids[r], prompt_mask[r], rows[r] if rows is not None else None)
        if key not in actor.key_to_prompt:
            raise KeyError(f"row {r} of the micro-batch has no prefix in window {actor.window}")
        index.append(actor.key_to_prompt[key])
    return torch.tensor(index, dtype=torch.long, device=prompt_ids.device)


def prepared_rows_logps(model: torch.nn.Module, rows: Sequence[PreparedPrompt], input_ids: torch.Tensor,
                        attention_mask: torch.Tensor, logits_to_keep: int, batch_size: int | None,
                        compute_entropy: bool, compute_aux_loss: bool, autocast: Callable[[], AbstractContextManager]
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The unshared path for prepared rows: TRL's chunked fused-head log-prob pass (full prompt + completion per
    row), with each chunk's vision inputs built from its rows (TRL passes none for video)."""
    batch_size = batch_size or input_ids.size(0)
    prompt_length = input_ids.size(1) - logits_to_keep
    device = input_ids.device
    all_logps, all_entropies, all_aux = [], [], []
    for start in range(0, input_ids.size(0), batch_size):
        end = min(start + batch_size, input_ids.size(0))
        chunk_rows = rows[start:end]
        ids, mask = input_ids[start:end], attention_mask[start:end]
        model_inputs = {"input_ids": ids, "attention_mask": mask, **vision_inputs(chunk_rows, device)}
        model_inputs["mm_token_type_ids"] = token_type_ids(chunk_rows, prompt_length, ids.size(1), device)
        if compute_aux_loss:
            model_inputs["output_router_logits"] = True
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        with autocast():
            outputs = model(**model_inputs, labels=labels, fused_lm_head=True)
        all_logps.append(outputs.log_probs[:, -logits_to_keep:])
        if compute_entropy:
            all_entropies.append(outputs.entropy[:, -logits_to_keep:])
        if compute_aux_loss:
            all_aux.append(outputs.aux_loss)
    logps = torch.cat(all_logps, dim=0)
    entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
    aux_loss = torch.stack(all_aux).mean() if compute_aux_loss else None
    return logps, entropies, aux_loss

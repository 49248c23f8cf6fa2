"""The shared prefix on the Megatron backend: each unique prompt's K/V computed once, the completions against it.

The HF backend's split (rollplex_trl/prefix/forward.py, docs/shared-prefix.md) on :class:`MegatronPolicy`:

    megatron_prefix:        U prompts x (P-1) tokens through GPTModel (vision tower once per prompt); every
                            layer's core attention records the key/value it receives (after RoPE, this rank's
                            KV heads) -> PrefixState, K/V kept with their autograd graph when asked
    megatron_suffix_logps:  R rows x [last prompt token, completion] through GPTModel; every layer's core attention
                            prepends its row's prompt K/V (``index_select``: the G rows' gradients sum into the
                            prompt's K/V, so the prompt's backward runs once) -> vocab-parallel log-probs

The hook is the core-attention module of GPTModel's layer spec (:class:`PrefixCoreAttention`, megatron-core's local
``DotProductAttention`` with a per-call K/V hook). Without an active hook it *is* DotProductAttention: the
full-sequence path is unchanged. With the prompt's P-1 cached keys in front of the suffix's S = 1 + C keys, the
suffix's attention scores have exactly the layout of the last S query rows of the full pass (the same P + C keys in
the same order, the same boolean mask, True = masked), so the numerics are the full pass's.

Positions continue the prompt's: Qwen2.5-VL's M-RoPE positions of the prompt come from the HF ``get_rope_index``
(padding-aware, so unchanged by dropping all-padding columns), the completion's are the last prompt token's + 1, 2,
... on all three axes (0 on right padding, as ``get_rope_index`` sets them); 1-D RoPE (Qwen2) and the VL fallback
without vision inputs count columns (``arange``), so a prefix whose padding columns were dropped keeps its column
offset.

The state is the HF backend's :class:`~rollplex_trl.prefix.state.PrefixState` (K/V as ``(U, kv_heads/t, P-1, hd)``
per layer), so ``take``, ``detach_prefix`` / ``backward_prefix`` (the actor's two-stage backward) and
``Precomputed`` apply unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from rollplex_trl import megatron_compat
from rollplex_trl.backends.megatron.logprobs import vocab_parallel_logps
from rollplex_trl.data.prompt import PreparedPrompt
from rollplex_trl.prefix.batch import Precomputed, group_by_prompt, prefix_inputs, shared_prefix_logps
from rollplex_trl.prefix.state import PrefixState

if TYPE_CHECKING:
    from rollplex_trl.backends.megatron.model import MegatronPolicy
    from rollplex_trl.backends.megatron.parallel import ParallelGroups


# ----------------------------------------------------------------------------------------------------------------
# The core-attention module with a K/V hook
# ----------------------------------------------------------------------------------------------------------------


class PrefixCoreAttention(megatron_compat.core_attention_base()):
    """megatron-core's ``DotProductAttention`` whose key/value pass through ``prefix_hook`` when one is set, and
    whose attention runs as one ``scaled_dot_product_attention`` call where it can.

    ``prefix_hook(module, key, value) -> (key, value)`` (sequence-first ``[s, b, groups, hd]``, RoPE applied) is set
    on the instances for the duration of a prefix or suffix pass by :func:`_hooked`; the class default ``None``
    leaves the keys and values DotProductAttention's.

    Why SDPA: DotProductAttention materialises the scores (baddbmm), masks and softmaxes them as separate ops and
    repeats the K/V heads for GQA; torch's fused kernel (what the hf backend's attention runs) does the same
    arithmetic in one pass, 1.3-3x faster forward + backward on CPU for these shapes. Same semantics: the boolean
    mask (True = masked) becomes megatron's -10000 fill as an additive mask, so a fully masked (padding) query row
    stays finite as in megatron (softmax of the raw scores instead of uniform: such rows feed no real token). It
    applies with a boolean mask and none of what the fused kernel lacks (dropout in training, a softmax offset,
    sliding windows, attention bias, packed sequences); otherwise, or with ``use_sdpa = False``,
    DotProductAttention's own path runs (tests/megatron compare the two)."""

    prefix_hook = None
    use_sdpa = True

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if self.prefix_hook is not None:
            key, value = self.prefix_hook(self, key, value)
        if self._sdpa_applies(attention_mask, attention_bias, packed_seq_params):
            return self._sdpa(query, key, value, attention_mask)
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, packed_seq_params=packed_seq_params)

    def _sdpa_applies(self, attention_mask, attention_bias, packed_seq_params) -> bool:
        dropout = self.attention_dropout.p if self.training else 0.0
        return (self.use_sdpa and isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
                and attention_bias is None and packed_seq_params is None and dropout == 0.0
                and self.softmax_offset is None and self.scale_mask_softmax.window_size is None)

    def _sdpa(self, query, key, value, attention_mask):
        # [s, b, heads, hd] -> [b, heads, s, hd]; GQA by the kernel's own head grouping (no repeated K/V)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        additive = torch.zeros(attention_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(attention_mask,
                                                                                                  -10000.0)
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=additive, scale=self.softmax_scale, enable_gqa=k.size(1) != q.size(1))
        # -> [s, b, heads * hd], DotProductAttention's output layout
        return context.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), self.hidden_size_per_partition)


def _core_attentions(policy: MegatronPolicy) -> list[PrefixCoreAttention]:
    found = [m for m in policy.gpt.decoder.modules() if isinstance(m, PrefixCoreAttention)]
    if len(found) != policy.gpt.config.num_layers:
        raise RuntimeError(f"the policy's GPTModel has {len(found)} PrefixCoreAttention modules for "
                           f"{policy.gpt.config.num_layers} layers: built without the prefix layer spec?")
    return found


@contextlib.contextmanager
def _hooked(modules: list[PrefixCoreAttention], hook) -> Iterator[None]:
    if any(vars(m).get("prefix_hook") is not None for m in modules):
        raise RuntimeError("a prefix/suffix pass is already running on this policy (nested passes are not supported)")
    for m in modules:
        m.prefix_hook = hook
    try:
        yield
    finally:
        for m in modules:
            vars(m).pop("prefix_hook", None)


class _Capture:
    """Records each layer's key/value once (the first call: a recompute would see the same tensors)."""

    def __init__(self, modules: list[PrefixCoreAttention]):
        self.index = {id(m): i for i, m in enumerate(modules)}
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(modules)

    def __call__(self, module, key, value):
        i = self.index[id(module)]
        if self.kv[i] is None:
            # [P-1, U, g, hd] -> the PrefixState layout (U, g, P-1, hd), compact (value is a view into the fused QKV)
            self.kv[i] = (key.permute(1, 2, 0, 3).contiguous(), value.permute(1, 2, 0, 3).contiguous())
        return key, value


class _Serve:
    """Prepends each row's prompt K/V (from the state, by ``rows``) to the suffix's own; stores nothing."""

    def __init__(self, modules: list[PrefixCoreAttention], state: PrefixState, rows: torch.Tensor):
        self.index = {id(m): i for i, m in enumerate(modules)}
        self.state, self.rows = state, rows
        self.served = [False] * len(modules)

    def __call__(self, module, key, value):
        i = self.index[id(module)]
        self.served[i] = True
        # The G-fold gather exists for one layer's attention (plus what attention saves for backward); index_select's
        # backward sums the rows' gradients into their prompt's K/V.
        k = self.state.keys[i].index_select(0, self.rows).permute(2, 0, 1, 3).to(key.dtype)
        v = self.state.values[i].index_select(0, self.rows).permute(2, 0, 1, 3).to(value.dtype)
        return torch.cat([k, key], dim=0), torch.cat([v, value], dim=0)


@contextlib.contextmanager
def _rope_offset(policy: MegatronPolicy, offset: int) -> Iterator[None]:
    """1-D RoPE: GPTModel numbers positions ``arange(s)``; shift them by ``offset`` (megatron's own argument)."""
    if policy.is_vl or not offset:
        yield
        return

    def hook(_module, args, kwargs):
        return args, {**kwargs, "offset": offset}

    handle = policy.gpt.rotary_pos_emb.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


# ----------------------------------------------------------------------------------------------------------------
# The state
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class MegatronPrefixState(PrefixState):
    """PrefixState (K/V per layer as ``(U, kv_heads/t, P-1, hd)``, this TP rank's heads) plus whether the positions
    came from ``get_rope_index`` (then a right-padded completion token has position 0, as there)."""

    rope_index: bool = False


def _prompt_positions(policy: MegatronPolicy, prompt_ids, prompt_mask, column_offset: int, mm_token_type_ids,
                      image_grid_thw, video_grid_thw, second_per_grid_ts) -> tuple[torch.Tensor, bool]:
    """The positions the full-sequence pass gives the prompt tokens: ``(3, U, P)`` M-RoPE or ``(U, P)``."""
    U, P = prompt_ids.shape
    arange = torch.arange(column_offset, column_offset + P, device=prompt_ids.device).expand(U, P)
    if not policy.is_vl:
        return arange, False
    if mm_token_type_ids is not None and (image_grid_thw is not None or video_grid_thw is not None):
        positions = policy._positions(prompt_ids, prompt_mask, mm_token_type_ids, image_grid_thw, video_grid_thw,
                                      second_per_grid_ts)
        return positions, True
    return arange.expand(3, U, P), False


# ----------------------------------------------------------------------------------------------------------------
# Prefix and suffix
# ----------------------------------------------------------------------------------------------------------------


def megatron_prefix(policy: MegatronPolicy, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, keep_graph: bool,
                    pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                    pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                    second_per_grid_ts: torch.Tensor | None = None, mm_token_type_ids: torch.Tensor | None = None,
                    column_offset: int = 0) -> MegatronPrefixState:
    """Run U unique left-padded prompts ``(U, P)`` once and keep every layer's K/V of ``prompt[:, :-1]``.

    The vision inputs are the U prompts' own, in prompt order (one copy each); ``mm_token_type_ids`` is ``(U, P)``.
    ``keep_graph=True`` keeps the autograd graph through the K/V (policy pass, vision tower included); ``False`` runs
    under no_grad. ``column_offset``: how many all-padding columns were dropped on the left of these prompts (1-D
    positions count columns). A collective over the TP group (call it on every TP rank with the same inputs).
    """
    if not bool(prompt_mask[:, -1].all()):
        raise ValueError("prompts must be left-padded: prompt_mask[:, -1] must be 1 in every row")
    if mm_token_type_ids is not None and bool(mm_token_type_ids[:, -1].any()):
        raise ValueError("the last prompt token must be a text token (it is re-run with the completion)")
    if not policy.is_vl and any(x is not None for x in (pixel_values, pixel_values_videos)):
        raise ValueError("vision inputs given to a text-only model")
    positions, rope_index = _prompt_positions(policy, prompt_ids, prompt_mask, column_offset, mm_token_type_ids,
                                              image_grid_thw, video_grid_thw, second_per_grid_ts)
    modules = _core_attentions(policy)
    capture = _Capture(modules)
    ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]
    with torch.set_grad_enabled(keep_graph), _hooked(modules, capture), _rope_offset(policy, column_offset), \
            policy._keep_last(1):
        # All vision tokens lie in prompt[:, :-1] (the last token is text): the vision tower runs here, once per
        # prompt. The output layer runs on one position only (its logits are unused).
        embeds = policy._embed(ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        policy.gpt(input_ids=ids, position_ids=positions[..., :-1] if policy.is_vl else None,
                   attention_mask=policy.attention_mask_4d(mask), decoder_input=embeds)
    missing = [i for i, kv in enumerate(capture.kv) if kv is None]
    if missing:
        raise RuntimeError(f"megatron_prefix: layers {missing} did not run their core attention")
    keys = [k for k, _ in capture.kv]
    values = [v for _, v in capture.kv]
    return MegatronPrefixState(
        keys=keys, values=values, prompt_mask=prompt_mask, last_token_ids=prompt_ids[:, -1],
        last_positions=positions[..., -1], num_layers=len(modules),
        has_graph=any(t.requires_grad for t in (*keys, *values)), rope_index=rope_index)


def gather_kv_heads(state: PrefixState, groups: ParallelGroups,
                    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PrefixState:
    """The state with every KV head, detached: each TP rank's ``(U, kv_heads/t, P-1, hd)`` K/V gathered in rank
    order (Megatron gives rank i the query groups ``[i g/t, (i+1) g/t)``, so this is the HF head order), for a
    decode that needs all heads (the transformers rollout). A collective over the TP group at t > 1 (one for K, one
    for V, all layers at once); at t = 1 the state's own tensors, detached.

    ``all_reduce``: the TP group's in-place all-reduce (the shared-memory one, `shm_all_reduce.py`) to gather with:
    each rank writes its heads into a zeroed full-width buffer and the sum is the gather, exactly (x + 0 = x).
    Otherwise ``dist.all_gather`` (gloo on CPU), which on the 2-core machine left the first rank's next decode
    running on about one core (0.25 vs 0.16 s, its OpenMP worker mostly idle; cause not found)."""
    keys = [k.detach() for k in state.keys]
    values = [v.detach() for v in state.values]
    t = groups.tp_size
    if t > 1:
        gathered = []
        for tensors in (keys, values):
            stacked = torch.stack(tensors)  # (layers, U, heads/t, P-1, hd)
            h = stacked.size(2)
            if all_reduce is not None:
                full = stacked.new_zeros(stacked.size(0), stacked.size(1), t * h, *stacked.shape[3:])
                full[:, :, groups.tp_rank * h:(groups.tp_rank + 1) * h] = stacked
                all_reduce(full)
            else:
                import torch.distributed as dist

                parts = [torch.empty_like(stacked) for _ in range(t)]
                dist.all_gather(parts, stacked.contiguous(), group=groups.tp_group)
                full = torch.cat(parts, dim=2)
            gathered.append(list(full.unbind(0)))
        keys, values = gathered
    return replace(state, keys=keys, values=values, has_graph=False)


def suffix_attention_mask(state: PrefixState, rows: torch.Tensor, suffix_mask: torch.Tensor) -> torch.Tensor:
    """``[R, 1, S, (P-1) + S]`` booleans, True = masked: the row's prompt padding, causal + key padding in the
    suffix; the last S query rows of the full pass's ``attention_mask_4d``."""
    S = suffix_mask.size(1)
    prompt_pad = (state.prompt_mask[rows, :-1] == 0)[:, None, None, :].expand(-1, 1, S, -1)
    causal = torch.ones(S, S, dtype=torch.bool, device=suffix_mask.device).triu(1)
    suffix = causal[None, None] | (suffix_mask == 0)[:, None, None, :]
    return torch.cat([prompt_pad, suffix], dim=-1)


def megatron_suffix_logps(policy: MegatronPolicy, state: PrefixState, row_to_prompt: torch.Tensor,
                          completion_ids: torch.Tensor, completion_mask: torch.Tensor, *, temperature: float = 1.0,
                          compute_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log-probs ``(R, C)`` (and entropies) of right-padded completions, row r continuing prompt
    ``row_to_prompt[r]`` of ``state``: what ``policy.token_logps`` gives on the full rows (padded positions
    included: they are not zeroed). Differentiable into the model and, through the state's K/V, into the prefix.
    A collective over the TP group."""
    rows = row_to_prompt.to(device=completion_ids.device, dtype=torch.long)
    C = completion_ids.size(1)
    S = 1 + C
    suffix_ids = torch.cat([state.last_token_ids[rows, None], completion_ids], dim=1)  # (R, S)
    suffix_mask = torch.cat([torch.ones_like(completion_mask[:, :1]), completion_mask], dim=1)
    offsets = torch.arange(S, device=suffix_ids.device)
    last = state.last_positions.index_select(-1, rows)
    rope_offset = 0
    if policy.is_vl:
        positions = last.unsqueeze(-1) + offsets  # (3, R, S): text continues the last prompt token on every axis
        if getattr(state, "rope_index", False):
            positions = positions.masked_fill(suffix_mask == 0, 0)  # get_rope_index leaves padding at 0
    else:
        positions = None
        rope_offset = int(last[0])
        if bool((last != rope_offset).any()):
            raise ValueError("1-D RoPE: the prompts of one suffix pass must share their last position (pad them "
                             "to one width)")
    modules = _core_attentions(policy)
    serve = _Serve(modules, state, rows)
    with _hooked(modules, serve), _rope_offset(policy, rope_offset):
        embeds = policy._embed(suffix_ids, None, None, None, None)
        logits = policy.gpt(input_ids=suffix_ids, position_ids=positions,
                            attention_mask=suffix_attention_mask(state, rows, suffix_mask), decoder_input=embeds)
    if not all(serve.served):
        raise RuntimeError("megatron_suffix_logps: some layers did not attend to the prompt's K/V")
    return vocab_parallel_logps(logits[:, :-1], completion_ids, temperature=temperature,
                                tp_group=policy.groups.tp_group, compute_entropy=compute_entropy)


# ----------------------------------------------------------------------------------------------------------------
# TRL's batches
# ----------------------------------------------------------------------------------------------------------------


def run_megatron_prefix(policy: MegatronPolicy, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        rows: Sequence[PreparedPrompt] | None, *, keep_graph: bool, trim: bool = True
                        ) -> MegatronPrefixState:
    """:func:`megatron_prefix` on U unique prompts given as left-padded rows and their ``PreparedPrompt``s (as
    ``rollplex_trl.prefix.batch.run_prefix``); all-padding columns are dropped first."""
    start, prompt_ids, prompt_mask, vision = prefix_inputs(prompt_ids, prompt_mask, rows, trim=trim)
    return megatron_prefix(policy, prompt_ids, prompt_mask, keep_graph=keep_graph, column_offset=start, **vision)


def megatron_shared_prefix_logps(policy: MegatronPolicy, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                 logits_to_keep: int, rows: Sequence[PreparedPrompt] | None, *, temperature: float,
                                 compute_entropy: bool, prompts_per_chunk: int,
                                 precomputed: Precomputed | None = None,
                                 ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``rollplex_trl.prefix.batch.shared_prefix_logps`` on the Megatron policy: the log-probs ``(R, C)`` (and
    entropies) ``policy.token_logps`` gives on TRL's batch, and the number of unique prompts, each unique prompt's
    prefix computed once (rows grouped by ``group_by_prompt``: their ``PreparedPrompt``, or the tokens of text-only
    rows). Runs under the caller's grad mode and autocast; with grad on, each chunk's prefix and suffixes form one
    graph. ``prompts_per_chunk`` bounds how many unique prompts (with all their rows) run at once. ``precomputed``:
    prefix states of exactly these prompts (built by :func:`megatron_precompute_prefix`). A collective over TP."""
    return shared_prefix_logps(policy, input_ids, attention_mask, logits_to_keep, rows, temperature=temperature,
                               compute_entropy=compute_entropy, prompts_per_chunk=prompts_per_chunk,
                               precomputed=precomputed, prefix_fn=run_megatron_prefix, suffix_fn=megatron_suffix_logps)


def megatron_precompute_prefix(policy: MegatronPolicy, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                               rows: Sequence[PreparedPrompt] | None, *, keep_graph: bool, prompts_per_chunk: int
                               ) -> Precomputed:
    """``rollplex_trl.prefix.batch.precompute_prefix`` on the Megatron policy: the unique prompts' states, chunk by
    chunk at the batch's full prompt width, concatenated so that any subset can be taken later."""
    groups = group_by_prompt(prompt_ids, prompt_mask, rows)
    states = []
    step = max(1, prompts_per_chunk)
    for start in range(0, len(groups.keys), step):
        first = groups.first_row[start:start + step]
        states.append(run_megatron_prefix(policy, prompt_ids[first], prompt_mask[first],
                                          [rows[r] for r in first] if rows is not None else None,
                                          keep_graph=keep_graph, trim=False))
    if len(states) == 1:
        return Precomputed(keys=groups.keys, state=states[0])
    rope_index = {s.rope_index for s in states}
    if len(rope_index) != 1:
        raise ValueError("chunks of one batch disagree on M-RoPE positions (some have vision inputs, some not)")
    state = MegatronPrefixState(
        keys=[torch.cat(ks) for ks in zip(*(s.keys for s in states))],
        values=[torch.cat(vs) for vs in zip(*(s.values for s in states))],
        prompt_mask=torch.cat([s.prompt_mask for s in states]),
        last_token_ids=torch.cat([s.last_token_ids for s in states]),
        last_positions=torch.cat([s.last_positions for s in states], dim=-1),
        num_layers=states[0].num_layers, has_graph=any(s.has_graph for s in states), rope_index=rope_index.pop())
    return Precomputed(keys=groups.keys, state=state)

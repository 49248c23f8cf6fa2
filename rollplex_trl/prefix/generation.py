"""Shared prefill for transformers' `generate`: each prompt's prefill runs once, its G samples decode from a copy.

`generate` on R = U*G rows prefills each prompt (vision tower included) G times. `generate_with_shared_prefill`
(called by the transformers rollout engine, rollout/transformers_rollout.py) prefills the U unique prompts once with
`prefix_forward` (K/V of prompt[:, :-1], the same positions HF's own prefill uses; `prefill_cache`), expands the
cache to the R rows, and calls HF's `generate` with that cache and without the vision inputs. HF then runs only the
last prompt token before sampling, exactly as when it continues generation from past key/values, so the sampling
loop and its random draws are unchanged. Nothing is patched: `model.generate` is the class's throughout.

A training backend whose policy is not the decoding model (Megatron) prefills with its policy instead
(`BackendPrefill`): the decode reads that K/V, cast to the dtypes the decoding model caches.

With `shared_decode` on (prefix/shared_decode.py) the cache is not expanded: the U prompts' K/V stay one copy per
prompt, each row keeps only its own K/V, and attention merges the two parts exactly (cascade attention).

The prefill calls the model's layers directly, so it runs inside `forward_context()`: the context the model's own
forward has (accelerate wraps `forward` in its autocast under bf16/fp16, and TRL's `generate` runs through that
wrapper), so the prompt's K/V are the ones TRL's own prefill would compute.

`PrefillForActor`: where the actor's window prefix is due at these very weights (the trainer decides), the prefill
keeps its autograd graph, checkpointed as training checkpoints (`PrefillForActor.checkpointing`: TRL's generation
context turns checkpointing off), and is handed to the actor window: the same forward the actor's prefix job would
run, so the policy's prompt forward runs once per step instead of twice (no-grad prefill, then the actor's prefix
job with its graph).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from rollplex_trl.data.prompt import PreparedPrompt
from rollplex_trl.prefix import compiled_decode
from rollplex_trl.prefix import shared_decode as sd
from rollplex_trl.prefix.batch import Precomputed, PromptGroups, StepPrefixes, group_by_prompt, run_prefix
from rollplex_trl.prefix.forward import cache_kwarg, unwrap_model
from rollplex_trl.prefix.state import PrefixState
from rollplex_trl.prefix.vision_reuse import VideoFeatureStore

_VISION_KWARGS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                  "mm_token_type_ids")

ContextFactory = Callable[[], contextlib.AbstractContextManager]


@dataclass
class PrefillForActor:
    """Asks each `generate` call's prefill to keep its autograd graph for the actor window.

    `wanted()` is asked before the prefill (the trainer's conditions: training, the actor prefix due in this window
    at these weights). `checkpointing()` is the context the kept prefill runs in: the policy's gradient
    checkpointing as training has it, as the actor's prefix job has it (`PrefixJobs.actor_checkpointing`). The
    prefill's prefix (graph-carrying K/V, vision tower included) for the call's unique prompts, grouped exactly as
    `precompute_prefix` groups them, then goes to `into.actor`, the step's `StepPrefixes`.
    """

    wanted: Callable[[], bool]
    into: StepPrefixes  # where the kept prefix goes (its `actor`)
    checkpointing: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


@dataclass(frozen=True)
class BackendPrefill:
    """A training backend's prefill for the transformers rollout (`generate_with_shared_prefill(prefill=)`), in
    place of the decoding model's own: the backend's policy computes the same K/V at the same weights, and a prefill
    kept for the actor window then is that backend's actor prefix (Megatron: backends/megatron/backend.py
    `rollout_prefill`).

    `run(prompt_ids (U, P), prompt_mask, rows or None, *, keep_graph)`: this process's `PrefixState` of the unique
    prompts' prompt[:, :-1] (RoPE applied; `last_positions` the decode continues from), the actor's prefix when
    kept. `for_decode(state)`: the state the decode reads, detached (Megatron at t > 1: the TP ranks' KV heads
    gathered; a collective). `context()`: what the prefill runs inside besides the trainer's autocast.
    """

    run: Callable[..., PrefixState]
    for_decode: Callable[[PrefixState], PrefixState] = lambda state: state
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def _transformers_prefill(model: torch.nn.Module, video_store: VideoFeatureStore | None = None) -> BackendPrefill:
    """The default prefill: the decoding model's own layers (`run_prefix`), 1-D RoPE positions numbered as HF's
    `generate` numbers them; video features reused from and recorded into `video_store` where given."""
    return BackendPrefill(run=functools.partial(run_prefix, model, generate_positions=True, video_store=video_store))


def _prefill_unique(prefill: BackendPrefill, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    rows: Sequence[PreparedPrompt] | None, *, keep_graph: bool = False
                    ) -> tuple[PrefixState, PromptGroups]:
    """K/V of prompt[:, :-1] for the unique prompts only, and which row continues which prompt. `keep_graph`: with
    autograd on (inside TRL's no_grad) and the graph kept, for the actor window (`PrefillForActor`)."""
    groups = group_by_prompt(input_ids, attention_mask, rows)
    first = groups.first_row
    unique_rows = [rows[r] for r in first] if rows is not None else None
    with prefill.context():
        state = prefill.run(input_ids[first], attention_mask[first], unique_rows, keep_graph=keep_graph)
    return state, groups


def prefill_for_rollout(prefill: BackendPrefill, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        rows: Sequence[PreparedPrompt] | None, *, for_actor: PrefillForActor | None,
                        forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                        ) -> tuple[PrefixState, PromptGroups]:
    """A generate call's prefill: the unique prompts' state for the decode and the rows' grouping; where
    `for_actor.wanted()`, the prefill runs with its graph, checkpointed as training checkpoints, and is kept in
    `for_actor.into.actor`. Also what a TP peer that does not decode runs (the pooled rollout: the same collectives)."""
    keep = for_actor is not None and for_actor.wanted()
    checkpointing = for_actor.checkpointing if keep else contextlib.nullcontext
    with forward_context(), checkpointing():
        state, groups = _prefill_unique(prefill, input_ids, attention_mask, rows, keep_graph=keep)
    if keep:  # the decode runs under no_grad: it reads these K/V without extending their graph
        for_actor.into.put("actor", Precomputed(keys=groups.keys, state=state))
    with torch.no_grad():
        return prefill.for_decode(state), groups


def _rope_deltas(state: PrefixState, groups: PromptGroups, attention_mask: torch.Tensor) -> torch.Tensor | None:
    """The rows' M-RoPE deltas as HF's decode steps use them (None for 1-D RoPE models)."""
    if not state.is_mrope:
        return None
    # HF's decode steps place token t of row r at `cumsum(mask) - 1 + rope_deltas[r]` on all three axes, with
    # rope_deltas = (position of the last prompt token) + 1 - (number of real prompt tokens).
    num_valid = attention_mask[groups.first_row].sum(-1)
    return (state.last_positions[0] + 1 - num_valid).index_select(0, groups.row_to_prompt).unsqueeze(-1)


def decode_kv_dtypes(causal_lm: torch.nn.Module) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes of the K and V that the decoding model's own attention caches, in the current autocast state: V
    is the projection's output (the autocast dtype under autocast, else the weights'); K is that after RoPE, whose
    cos/sin come in the hidden states' dtype (the embeddings'), so their promotion (fp32 under a bf16 autocast of
    fp32 weights). A prefill by another backend's kernels is cast to these (tests/megatron/test_megatron_prefix.py
    checks them against HF's own prefill)."""
    weight = causal_lm.get_input_embeddings().weight
    device = weight.device.type
    value = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return torch.promote_types(value, weight.dtype), value


def _cast_kv(state: PrefixState, dtypes: tuple[torch.dtype, torch.dtype] | None
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The state's K/V for the decode cache, in `dtypes` (K, V) where given (no copy where they already are)."""
    if dtypes is None:
        return list(state.keys), list(state.values)
    return [k.to(dtypes[0]) for k in state.keys], [v.to(dtypes[1]) for v in state.values]


def _expanded_cache(state: PrefixState, groups: PromptGroups, width: int,
                    dtypes: tuple[torch.dtype, torch.dtype] | None = None) -> DynamicCache:
    """Today's cache: the prompt K/V copied to all R rows, left-padded back to the batch's prompt width."""
    # run_prefix drops all-padding columns; the R rows keep TRL's width, so pad the cache back on the left.
    missing = width - state.prompt_length
    expand = groups.row_to_prompt
    layers = []
    for k, v in zip(*_cast_kv(state, dtypes)):
        if missing:
            pad = k.new_zeros(k.size(0), k.size(1), missing, k.size(3))
            k, v = torch.cat([pad, k], dim=2), torch.cat([pad, v], dim=2)
        layers.append((k.index_select(0, expand), v.index_select(0, expand)))
    return DynamicCache(ddp_cache_data=layers)


def _shared_cache(state: PrefixState, groups: PromptGroups, width: int, capacity: int,
                  dtypes: tuple[torch.dtype, torch.dtype] | None = None) -> sd.SharedPrefixCache:
    """The shared-prefix decode cache: the prompt K/V once per prompt (HF sees `width - 1` prompt positions)."""
    keys, values = _cast_kv(state, dtypes)
    return sd.build_cache(keys, values, state.prompt_mask[:, :-1], groups.row_to_prompt, offset=width - 1,
                          capacity=capacity)


def _use_shared_decode(mode: str, causal_lm: torch.nn.Module, kwargs: dict, num_generations: int) -> bool:
    """Whether this generate call decodes with the shared-prefix cache. 'on' raises where it cannot apply; 'auto'
    is on from `AUTO_MIN_GENERATIONS` completions per prompt (where the benchmark shows it pays) and falls back with
    the reason logged once where it cannot apply."""
    if mode == "off" or (mode == "auto" and not sd.auto_applies(num_generations)):
        return False
    reason = sd.unsupported_reason(causal_lm, kwargs)
    if reason is None:
        return True
    if mode == "on":
        raise ValueError(f"rollplex_shared_decode='on' cannot apply: {reason}. Use 'auto' or 'off'.")
    sd.log_once(reason)
    return False


@dataclass
class PrefilledCache:
    """A generate call's prefill, ready for HF's decode (`prefill_cache`): the cache `generate` continues from."""

    cache: DynamicCache | sd.SharedPrefixCache
    shared: bool  # the shared-prefix cache (prefix/shared_decode.py), else the expanded one
    compiled: bool  # decode steps through the compiled forward (prefix/compiled_decode.py)
    unique_prompts: int


def prefill_cache(causal_lm: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  rows: Sequence[PreparedPrompt] | None, generate_kwargs: dict, *, shared_decode: str = "off",
                  num_generations: int | None = None, for_actor: PrefillForActor | None = None,
                  compile_decode: str = "off",
                  forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                  prefill: BackendPrefill | None = None, video_store: VideoFeatureStore | None = None
                  ) -> PrefilledCache:
    """Prefill each unique prompt of the R = U*G rows once and build the decode cache of the R rows: expanded (the
    prompt K/V copied to every row) or, per `shared_decode`, shared (held once per prompt). Sets the backbone's
    M-RoPE deltas for HF's decode steps. `generate_kwargs`: what the decode's `generate` gets besides the ids, mask
    and cache (read, not changed: the generation config decides the shared cache's capacity). `video_store`: the
    step's video features (prefix/vision_reuse.py), for the decoding model's own prefill (a backend's ignores it)."""
    state, groups = prefill_for_rollout(prefill or _transformers_prefill(causal_lm, video_store), input_ids,
                                        attention_mask, rows, for_actor=for_actor, forward_context=forward_context)
    dtypes = None
    if prefill is not None:
        # another backend's kernels may leave K/V in other dtypes than the decoding model caches (Megatron's
        # V stays fp32 under autocast): the cache takes the decoding model's (its own prefill's are those)
        with forward_context():
            dtypes = decode_kv_dtypes(causal_lm)
    rows_per_prompt = num_generations or input_ids.size(0) // max(1, len(groups.first_row))
    shared = _use_shared_decode(shared_decode, causal_lm, generate_kwargs, rows_per_prompt)
    compiled = compiled_decode.use_compiled_decode(compile_decode, shared)
    width = input_ids.size(1)
    if shared:
        capacity = sd.expected_suffix_length(causal_lm, generate_kwargs, width)
        cache = _shared_cache(state, groups, width, capacity, dtypes)
    else:
        cache = _expanded_cache(state, groups, width, dtypes)
    deltas = _rope_deltas(state, groups, attention_mask)
    if deltas is not None:
        causal_lm.base_model.rope_deltas = deltas
    return PrefilledCache(cache=cache, shared=shared, compiled=compiled, unique_prompts=len(groups.first_row))


def without_vision(generate_kwargs: dict) -> dict:
    """The decode's `generate` arguments without the vision inputs: all vision tokens are in the prefilled cache, HF
    must not encode them again."""
    return {k: v for k, v in generate_kwargs.items() if k not in _VISION_KWARGS}


@contextlib.contextmanager
def decoding(causal_lm: torch.nn.Module, prefilled: PrefilledCache, window: contextlib.AbstractContextManager,
             forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
             decode_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
             ) -> Iterator[None]:
    """The contexts HF's decode from `prefilled` runs in: the decode `window` (overlap prefix jobs), the
    shared-prefix decode, the compiled decode step, the model's forward context and `decode_context()`."""
    decoding_ = sd.decoding_with(causal_lm, prefilled.cache) if prefilled.shared else contextlib.nullcontext()
    step = (compiled_decode.compiled_decoding(causal_lm, sd.decoding_on_this_thread) if prefilled.compiled
            else contextlib.nullcontext())
    # One autocast around all decode steps (the model's wrapped forward enters its own at every step, nested in
    # this one): autocast then casts each weight to bf16 once per generate call instead of once per step, the
    # same values. It closes before the window's serial prefix jobs run (exits go in reverse order): a cast
    # cached under no_grad has no graph, and the actor's job needs one (autocast state is per thread, so the
    # concurrent jobs on the worker thread never see this cache)
    with window, decoding_, step, forward_context(), decode_context():
        yield
    if prefilled.shared:
        prefilled.cache.check_used()


def generate_with_shared_prefill(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                 rows: Sequence[PreparedPrompt] | None = None, *, on_prefill=None,
                                 decode_window=None, shared_decode: str = "off", num_generations: int | None = None,
                                 for_actor: PrefillForActor | None = None, compile_decode: str = "off",
                                 forward_context: ContextFactory = contextlib.nullcontext,
                                 decode_context: ContextFactory = contextlib.nullcontext,
                                 prefill: BackendPrefill | None = None,
                                 video_store: VideoFeatureStore | None = None, **generate_kwargs):
    """`model.generate(input_ids=, attention_mask=, **generate_kwargs)` with each unique prompt prefilled once: the
    prefill (`prefill_cache`), then HF's `generate` from that cache, without the vision inputs, inside `decoding`.

    `rows` are the batch's prepared prompts (None for text-only prompts, grouped by their tokens).
    `on_prefill(rows, unique_prompts)` is called after the prefill (for metrics). `decode_window(input_ids,
    attention_mask)`, a context manager factory, wraps the decoding itself (the overlap runs prefix work inside it).
    `shared_decode` ("auto", "on", "off"): decode with the prompt's K/V held once per prompt (shared_decode.py)
    instead of copied to every row; "auto" decides by `num_generations` (G; the batch's rows per prompt if None).
    `for_actor`: keep the prefill's graph for the actor window where `for_actor.wanted()` (the decode only reads it).
    `compile_decode` ("auto", "on", "off"): shared-prefix decode steps through a compiled forward
    (prefix/compiled_decode.py). `forward_context()`: what the model's own forward runs inside (the trainer's
    autocast); the prefill, which calls the layers directly, runs inside it too. `decode_context()`: entered around
    the decode steps only, inside the decode window (the trainer's: frozen weights' autocast casts kept,
    rollout/weight_casts.py). `prefill`: a training backend's prefill (`BackendPrefill`) in place of the decoding
    model's own layers. `video_store`: video features shared between this step's prefills (prefix/vision_reuse.py).
    """
    causal_lm = unwrap_model(model)
    prefilled = prefill_cache(causal_lm, input_ids, attention_mask, rows, generate_kwargs,
                              shared_decode=shared_decode, num_generations=num_generations, for_actor=for_actor,
                              compile_decode=compile_decode, forward_context=forward_context, prefill=prefill,
                              video_store=video_store)
    if on_prefill is not None:
        on_prefill(input_ids.size(0), prefilled.unique_prompts)
    window = decode_window(input_ids, attention_mask) if decode_window is not None else contextlib.nullcontext()
    with decoding(causal_lm, prefilled, window, forward_context, decode_context):
        return model.generate(input_ids=input_ids, attention_mask=attention_mask,
                              **{cache_kwarg(causal_lm): prefilled.cache}, **without_vision(generate_kwargs))

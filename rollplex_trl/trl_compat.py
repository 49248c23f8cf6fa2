"""The one module that touches TRL's and transformers' internals: a TRL upgrade is a review of this file plus the
parity tests (tests/test_trl_compat.py fails loudly where an upstream name or signature changed, and where a private
name is used outside this module).

What lives here, each with why:
- the supported version range (checked at import);
- imports from inside TRL modules (not part of `trl`'s public namespace);
- `TRL_OVERRIDES`: the private methods `RollplexGRPOTrainer` overrides, with the parameters it relies on;
- accessors for private attributes of TRL's trainer and of its vLLM generation object;
- the pieces of TRL's regular generation the transformers engine re-implements (rollout/transformers_rollout.py),
  and the hash of that branch's source that pins it;
- the trainer that runs a callback (a call-stack search: transformers never hands callbacks their trainer);
- transformers' cache classes the prefix caches subclass, with the attributes and methods they rely on;
- the runtime patches: building our vLLM generation object where TRL builds its own, wrapping TRL's `_generate` in a
  memory phase, reading TRL's fused-LM-head closure, and the transformers gradient-checkpointing attributes the
  prefix pass reads and sets;
- transformers' attention dispatch: registering the cascade wrappers and switching a model's text config to one
  for a call (prefix/suffix_attention.py, prefix/shared_decode.py).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers
import trl
from packaging.version import Version

# ------------------------------------------------------------------------------------------------------------------
# Versions
# ------------------------------------------------------------------------------------------------------------------

SUPPORTED_TRL = ("1.16", "1.17")  # [min, max): every name below was read in TRL 1.16's sources
SUPPORTED_TRANSFORMERS = ("5.16", "6")  # the vLLM tier runs 5.19, the main environment 5.24


def check_versions(trl_version: str = trl.__version__, transformers_version: str = transformers.__version__) -> None:
    """Refuse an untested TRL (its private methods are overridden here) or transformers major version."""
    for name, found, (low, high) in (("trl", trl_version, SUPPORTED_TRL),
                                     ("transformers", transformers_version, SUPPORTED_TRANSFORMERS)):
        if not Version(low) <= Version(found) < Version(high):
            raise ImportError(f"rollplex_trl supports {name} >={low},<{high}; found {found}. Install a supported "
                              f"version, or review rollplex_trl/trl_compat.py against {name} {found}.")


check_versions()

# ------------------------------------------------------------------------------------------------------------------
# Imports from inside TRL modules (why: none of these is exported by `trl` itself)
# ------------------------------------------------------------------------------------------------------------------

from trl.extras.profiling import profiling_context  # noqa: E402  TRL's timing of the vLLM generate call
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402  the class our vLLM engine stands in for
from trl.trainer.grpo_trainer import is_async_callable  # noqa: E402  TRL's own test for async reward functions
from trl.trainer.utils import RepeatSampler, ensure_master_addr_port  # noqa: E402  sampler we extend; env for vLLM

__all__ = ["RepeatSampler", "VLLMGeneration", "ensure_master_addr_port", "is_async_callable", "profiling_context",
           "Cache", "CacheLayerMixin", "DynamicLayer"]

# ------------------------------------------------------------------------------------------------------------------
# transformers' cache classes, subclassed by the prefix pass (prefix/forward.py, prefix/suffix_attention.py) and by
# shared-prefix decoding (prefix/shared_decode.py). Why here: transformers documents no cache-layer subclassing API;
# the subclasses set the attributes below directly (a layer built around existing K/V, never lazily initialized)
# and inherit DynamicLayer's methods that read them. tests/test_trl_compat.py checks each name.
# ------------------------------------------------------------------------------------------------------------------

from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer  # noqa: E402

# instance attributes our layers set and transformers' Cache / DynamicLayer read
CACHE_LAYER_ATTRIBUTES = ("keys", "values", "device", "is_initialized")
# methods of DynamicLayer our layers call or inherit: name -> the parameters we pass or rely on
CACHE_LAYER_METHODS: dict[str, tuple[str, ...]] = {
    "lazy_initialization": ("key_states", "value_states"),  # _CaptureLayer's first update
    "update": ("key_states", "value_states"),  # overridden by every layer; Cache calls it positionally
    "get_seq_length": (),  # inherited by _ReadOnlyLayer / CascadeSuffixLayer: reads keys and is_initialized
    "get_mask_sizes": ("query_length",),  # inherited likewise
    "crop": ("tokens_to_remove",),  # SharedPrefixLayer follows DynamicLayer's negative-count convention
}
# the abstract methods of CacheLayerMixin SharedPrefixLayer implements (a new one would make it unbuildable)
CACHE_LAYER_ABSTRACT = frozenset({"lazy_initialization", "update", "get_mask_sizes", "get_seq_length",
                                  "get_max_length"})

# ------------------------------------------------------------------------------------------------------------------
# Private methods RollplexGRPOTrainer overrides: name -> (parameters we rely on, why)
# ------------------------------------------------------------------------------------------------------------------

TRL_OVERRIDES: dict[str, tuple[tuple[str, ...], str]] = {
    "_generate_and_score_completions": (("inputs",), "prepares streamed video rows; carries each row's prepared "
                                        "prompt through TRL's shuffling and splitting"),
    "_tokenize_prompts": (("prompts",), "token ids and vision tensors come from the prepared prompts"),
    "_generate_single_turn": (("prompt_ids", "images", "multimodal_fields", "num_generations"),
                              "the shared prefill and the decode window (transformers), the vLLM engine"),
    "_get_per_token_logps_and_entropies": (("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                                            "compute_entropy"), "shared-prefix log-probs; video inputs per chunk"),
    "_calculate_rewards": (("inputs", "prompts", "completions", "completion_ids_list"),
                           "T-GRPO and length control fill their reward columns from the gathered rewards"),
    "_get_train_sampler": (("dataset",), "a sampler that replays later epochs' order on resume"),
    "_load_from_checkpoint": (("resume_from_checkpoint", "model"), "legacy weight names of Qwen2.5-VL"),
    "_load_best_model": ((), "legacy weight names of Qwen2.5-VL"),
    "_save_checkpoint": (("model", "trial"), "checkpoints written to a staging folder and renamed when complete"),
    "_get_output_dir": (("trial",), "the staging folder while a checkpoint is written"),
    "_push_from_checkpoint": (("checkpoint_folder",), "upload once the staged checkpoint has its final name"),
    "_get_eval_sampler": (("eval_dataset",), "Megatron TP: the ranks of a TP group get the same rows"),
    "_clip_grad_norm": (("model",), "Megatron backend: DP-averaged, TP-aware norm of the Megatron parameters"),
    "_get_grad_norm": (("model", "grad_norm"), "Megatron backend: the same norm when clipping is off"),
    "_save_optimizer_and_scheduler": (("output_dir",), "Megatron TP: each TP rank's optimizer state"),
    "_load_optimizer_and_scheduler": (("checkpoint",), "Megatron TP: each TP rank's optimizer state"),
}

# ------------------------------------------------------------------------------------------------------------------
# Private attributes of TRL's GRPOTrainer (why: TRL keeps these state holders private and offers no accessor)
# ------------------------------------------------------------------------------------------------------------------


def metrics(trainer: Any, training: bool) -> dict[str, list[float]]:
    """TRL's per-mode metric lists, averaged and logged at each logging step (where `rollplex/*` go)."""
    return trainer._metrics["train" if training else "eval"]


def has_trl_metrics(trainer: Any) -> bool:
    """Whether `trainer` keeps TRL's metric lists (a plain transformers Trainer does not)."""
    return getattr(trainer, "_metrics", None) is not None


def buffered_inputs(trainer: Any) -> list[dict]:
    """The micro-batches of the current generation batch (TRL generates once per `steps_per_generation`)."""
    return trainer._buffered_inputs


def train_batch_size(trainer: Any) -> int:
    """The per-device train batch size the Trainer's data loader uses (after auto batch-size finding)."""
    return trainer._train_batch_size


def micro_step(trainer: Any) -> int:
    """TRL's micro-step counter (which buffered micro-batch is next)."""
    return trainer._step


def add_to_step_time(trainer: Any, seconds: float) -> None:
    """Count `seconds` of work done after TRL's `training_step` returned (the actor prefix's backward, which runs
    once the window's last micro-step has its loss) into TRL's `step_time` metric, which TRL times around its own
    `training_step` only. If this micro-step closed an optimizer step, TRL has just appended the step's time: add
    to that entry; otherwise to the running sum TRL appends at the step's last micro-step."""
    times = trainer._metrics["train"]["step_time"]
    if trainer._step % trainer.current_gradient_accumulation_steps == 0 and times:
        times[-1] += seconds
    else:
        trainer._current_train_step_time += seconds


def generation_prompt_tensors(trainer: Any, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The left-padded prompt ids and attention mask TRL's transformers generate path builds from `prompt_ids`
    (`_generate_single_turn`: `pad(..., padding_side="left", pad_to_multiple_of=...)`, on the trainer's device)."""
    from trl.trainer.utils import pad

    tensors = [torch.tensor(ids) for ids in prompt_ids]
    multiple = trainer.pad_to_multiple_of
    ids = pad(tensors, padding_value=trainer._tokenizer.pad_token_id, padding_side="left",
              pad_to_multiple_of=multiple)
    mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left",
               pad_to_multiple_of=multiple)
    device = trainer.accelerator.device
    return ids.to(device), mask.to(device)


# TRL's regular (transformers) generation branch of `GRPOTrainer._generate_single_turn`, re-implemented by
# rollout/transformers_rollout.py with the shared prefill called directly (no patch of `generate`). The sha256 of
# that branch's source (from its `else:` to the method's return) pins it: tests/test_trl_compat.py fails when a TRL
# upgrade changes it, and then the engine's steps (padding, multimodal fields, `_prepare_inputs`, the generation
# context, the EOS mask) are re-checked against the new branch and the hash updated.
TRL_REGULAR_GENERATION_SHA256 = "0c27d37e3243e3cbb724f0818e27c6c6922fd2362b43b5a9a8f0da423da7852f"


def regular_generation_source() -> str:
    """The source of TRL's regular-generation branch of `_generate_single_turn` (what TRL_REGULAR_GENERATION_SHA256
    pins): from `else:` before "Regular generation path" to `return completion_ids, logprobs`."""
    source = inspect.getsource(trl.GRPOTrainer._generate_single_turn)
    start = source.index("        else:\n            # Regular generation path")
    end = source.index("return completion_ids, logprobs", start) + len("return completion_ids, logprobs")
    return source[start:end]


def pad_left(trainer: Any, tensors: list[torch.Tensor], padding_value: int) -> torch.Tensor:
    """TRL's left padding of the generation inputs (`pad(..., padding_side="left", pad_to_multiple_of=...)`)."""
    from trl.trainer.utils import pad

    return pad(tensors, padding_value=padding_value, padding_side="left", pad_to_multiple_of=trainer.pad_to_multiple_of)


def prepare_generation_inputs(trainer: Any, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What TRL's `super()._prepare_inputs(generate_inputs)` does in `_generate_single_turn`: the Trainer's own
    `_prepare_inputs` (tensors to the device), not GRPOTrainer's override (which buffers generations)."""
    return super(trl.GRPOTrainer, trainer)._prepare_inputs(inputs)


@contextlib.contextmanager
def generation_model(trainer: Any) -> Iterator[torch.nn.Module]:
    """The contexts TRL's regular generation runs `generate` in, yielding the model to call: the profiling of
    "transformers.generate", `unwrap_model_for_generation` with TRL's arguments, no_grad and the distributed
    backend's `summon_full_params`."""
    from trl.models import unwrap_model_for_generation

    with (
        profiling_context(trainer, "transformers.generate"),
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as unwrapped_model,
        torch.no_grad(),
        trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False),
    ):
        yield unwrapped_model


def generation_config(trainer: Any) -> Any:
    """The GenerationConfig TRL passes to `generate` (built from GRPOConfig's sampling options)."""
    return trainer.generation_config


def eos_token_ids(trainer: Any) -> list[int]:
    """The token ids that end a completion (TRL masks everything after the first one)."""
    return trainer.eos_token_ids


def pad_token_id(trainer: Any) -> int:
    """The tokenizer's pad id (TRL unwraps the processor's tokenizer into `_tokenizer`)."""
    return trainer._tokenizer.pad_token_id


def is_vlm(trainer: Any) -> bool:
    """Whether TRL treats the processing class as a vision-language processor."""
    return trainer._is_vlm


def last_loaded_step(trainer: Any) -> int | None:
    """The optimizer step whose weights the vLLM engine holds (TRL's own counter, so its paths agree with ours)."""
    return getattr(trainer, "_last_loaded_step", None)


def set_last_loaded_step(trainer: Any, step: int) -> None:
    trainer._last_loaded_step = step


# ------------------------------------------------------------------------------------------------------------------
# TRL's VLLMGeneration: where it is built, and the private state our subclass keeps consistent
# ------------------------------------------------------------------------------------------------------------------

VLLM_INIT_METHOD = "_init_vllm"  # the method of VLLMGeneration that builds the engine; our subclass overrides it
_SWAP_LOCK = threading.Lock()


@contextlib.contextmanager
def trl_builds_vllm_generation(factory: Callable[..., Any]) -> Iterator[None]:
    """Inside the block, GRPOTrainer.__init__ calls `factory` where it constructs TRL's VLLMGeneration (it reads the
    name from its module's globals; no constructor argument selects the class)."""
    import trl.trainer.grpo_trainer as grpo_module

    with _SWAP_LOCK:
        original = grpo_module.VLLMGeneration
        grpo_module.VLLMGeneration = factory
        try:
            yield
        finally:
            grpo_module.VLLMGeneration = original


def vllm_generation_shards_parameters(generation: Any) -> bool:
    """ZeRO-3 or FSDP: the trainer's parameters are sharded, which our in-place weight reads cannot follow."""
    return bool(generation._dist.is_zero3 or generation._dist.is_fsdp)


def mark_vllm_weights_awake(generation: Any) -> None:
    """TRL's sleep bookkeeping: the engine's weights are loaded (TRL reads this before generating)."""
    generation._llm_weights_sleeping = False


def trl_named_rewards() -> dict[str, Any]:
    """TRL's named reward functions with the settings `trl grpo` registers them under (`trl.rewards` is a TRL
    submodule; `rollplex-trl grpo --reward_funcs NAME` resolves the same names)."""
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    return {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    }


def resolve_accelerate_config_argument(launcher_args: list[str]) -> list[str]:
    """TRL's reading of `--accelerate_config NAME|PATH` into `accelerate launch` arguments (as `trl grpo` does)."""
    from trl.cli.accelerate_config import resolve_accelerate_config_argument as resolve

    return resolve(launcher_args)


# `accelerate launch`'s flags whose absence (without an accelerate config file) makes it warn that it used defaults.
ACCELERATE_DEFAULTED_FLAGS = ("--config_file", "--num_processes", "--num_machines", "--mixed_precision",
                              "--dynamo_backend")


@contextlib.contextmanager
def quiet_accelerate_launch_defaults() -> Iterator[None]:
    """Silence `accelerate launch`'s "The following values were not passed ... `--num_processes` was set to a value
    of `0`" for the call: for `rollplex-trl grpo` without launcher flags that is the expected single-process run,
    and the start-up banner states the world size. Only its module's logger, only at WARNING, only meanwhile."""
    logger = logging.getLogger("accelerate.commands.launch")
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def trainer_init_arguments(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """GRPOTrainer.__init__'s arguments by name (model, reward_funcs, args, train_dataset, ...), before it runs."""
    return inspect.signature(trl.GRPOTrainer.__init__).bind(None, *args, **kwargs).arguments


def trainer_running_callback(callback: Any, max_frames: int = 30) -> Any:
    """The Trainer whose callback handler holds `callback`, found among the callers' frames (None if none is).

    Why a stack search: transformers passes callbacks the model, optimizer and dataloaders but never the trainer,
    and a callback given in ``callbacks=[...]`` exists before its trainer does; the training loop that fires
    ``on_train_begin`` is a method of that trainer, so its ``self`` is a few frames up. Callers that can pass the
    trainer explicitly (``TimelineImageCallback(trainer)``, as RollplexGRPOTrainer does) never get here.
    """
    frame = inspect.currentframe()
    try:
        for _ in range(max_frames):
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            handler = getattr(owner, "callback_handler", None)
            if handler is not None and any(cb is callback for cb in getattr(handler, "callbacks", [])):
                return owner
            frame = frame.f_back
    finally:
        del frame  # frames hold their locals: do not keep the stack alive
    return None


# ------------------------------------------------------------------------------------------------------------------
# Runtime patches and reads of patched state
# ------------------------------------------------------------------------------------------------------------------

GENERATE_METHOD = "_generate"  # GRPOTrainer's rollout entry: no callback fires around it, so the memory ledger wraps it


def fused_head_settings(causal_lm: torch.nn.Module) -> dict | None:
    """The settings of TRL's `add_fused_lm_head` patch on this model, or None if it is not patched.

    The patch replaces the instance's `forward` by a closure; its free variables hold the temperature and outputs
    (TRL keeps no other record of them).
    """
    fn = getattr(vars(causal_lm).get("forward"), "__func__", None)
    if fn is None or "fused_lm_head" not in fn.__code__.co_varnames:
        return None
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    return {name: cell.cell_contents for name, cell in cells.items() if name in ("temperature", "outputs")}


def checkpointing_is_non_reentrant(layer: torch.nn.Module) -> bool:
    """Whether a transformers decoder layer's gradient checkpointing is the non-reentrant kind (the partial
    function transformers installs as `_gradient_checkpointing_func` carries `use_reentrant`)."""
    keywords = getattr(getattr(layer, "_gradient_checkpointing_func", None), "keywords", None) or {}
    return keywords.get("use_reentrant") is False


def keep_model_unwrapped(accelerator: Any, model: torch.nn.Module) -> None:
    """The Trainer prepares `model` with `accelerator.prepare` inside `train()`, which wraps it in DDP on every
    multi-process run (on CPU even without a trainable parameter). The Megatron backend reduces its own gradients
    and never runs the transformers model's forward in training: ask accelerate to prepare that model as for
    evaluation (no DDP) and without moving it: its tensors are views of the training parameters, and on a
    multi-process CPU run accelerate's device is "cpu:0", to which `.to()` copies every tensor (ending the
    aliasing). Other objects are prepared as before."""
    original = accelerator.prepare_model

    def prepare_model(obj, device_placement=None, evaluation_mode=False):
        if obj is model:
            return original(obj, device_placement=False, evaluation_mode=True)
        return original(obj, device_placement=device_placement, evaluation_mode=evaluation_mode)

    accelerator.prepare_model = prepare_model


# transformers' per-module gradient checkpointing state (why: TRL's `unwrap_model_for_generation` turns
# checkpointing off for the whole generation, and the actor's prefix job runs inside it, in the decode window;
# transformers keeps the state on each module as the flag `gradient_checkpointing` and the instance attribute
# `_gradient_checkpointing_func`, which `gradient_checkpointing_disable` resets to a plain `checkpoint` without the
# user's `gradient_checkpointing_kwargs`, so the state is snapshotted while it is on rather than re-enabled)
CheckpointingState = list[tuple[torch.nn.Module, bool, Any]]
_NO_FUNC = object()  # the module had no instance `_gradient_checkpointing_func`


def checkpointing_state(model: torch.nn.Module) -> CheckpointingState:
    """Each module's gradient checkpointing flag and function, as they are now (every module with the flag)."""
    return _checkpointing_state_of([m for m in model.modules() if hasattr(m, "gradient_checkpointing")])


def _checkpointing_state_of(modules: list[torch.nn.Module]) -> CheckpointingState:
    return [(m, bool(m.gradient_checkpointing), vars(m).get("_gradient_checkpointing_func", _NO_FUNC))
            for m in modules]


def _apply_checkpointing_state(state: CheckpointingState) -> None:
    for module, flag, func in state:
        module.gradient_checkpointing = flag
        if func is _NO_FUNC:
            vars(module).pop("_gradient_checkpointing_func", None)
        else:
            module._gradient_checkpointing_func = func


@contextlib.contextmanager
def checkpointing_as(state: CheckpointingState) -> Iterator[None]:
    """Within the block the modules checkpoint as in `state` (a `checkpointing_state` taken while training had it);
    after it, as they did before the block. Safe while another thread decodes with the same modules under no_grad:
    transformers checkpoints a layer (and drops its cache) only when grad mode, which is per thread, is on."""
    before = _checkpointing_state_of([module for module, _, _ in state])
    _apply_checkpointing_state(state)
    try:
        yield
    finally:
        _apply_checkpointing_state(before)


CHECKPOINT_WITH_CACHE_FLAG = "_can_checkpoint_with_cache"  # transformers keeps a cache under checkpointing only then


@contextlib.contextmanager
def checkpointed_forwards_within(layers: Any, context: Callable[[], Any]) -> Iterator[None]:
    """Within the block, run each checkpointed decoder layer's forward inside a fresh `context()`: the first run
    and also the recompute that the backward replays later, outside the block (transformers' checkpointing layers
    call the instance attribute `_gradient_checkpointing_func(partial(forward, ...), *args)`, and non-reentrant
    checkpointing recomputes that same function). Layers without checkpointing run inside the caller's block."""

    def wrap(original: Callable) -> Callable:
        def run(forward: Callable, *args: Any, **kwargs: Any) -> Any:
            def inside(*inner_args: Any, **inner_kwargs: Any) -> Any:
                with context():
                    return forward(*inner_args, **inner_kwargs)

            return original(inside, *args, **kwargs)

        return run

    touched = []
    try:
        for layer in layers:
            original = vars(layer).get("_gradient_checkpointing_func")
            if original is not None:
                layer._gradient_checkpointing_func = wrap(original)
                touched.append((layer, original))
        yield
    finally:
        for layer, original in touched:
            layer._gradient_checkpointing_func = original


# ------------------------------------------------------------------------------------------------------------------
# transformers' attention dispatch (why: the cascade wrappers of prefix/suffix_attention.py and
# prefix/shared_decode.py are registered implementations, switched on the text config for one call; transformers
# reads the implementation from the private `config._attn_implementation` and keeps registrations in the private
# `AttentionInterface._global_mapping`)
# ------------------------------------------------------------------------------------------------------------------


def register_attention(name: str, function: Callable, mask_like: str) -> None:
    """Register `function` as the attention implementation `name` (idempotent), with the mask function of
    `mask_like` ("sdpa" or "eager") under the same name, so HF builds exactly the mask that implementation gets."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    if name in AttentionInterface._global_mapping:
        return
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, {"sdpa": sdpa_mask, "eager": eager_mask}[mask_like])


def attention_implementation(model: torch.nn.Module) -> str | None:
    """The attention implementation the model's text config dispatches to ("sdpa", "eager", a registered name)."""
    return getattr(model.config.get_text_config(), "_attn_implementation", None)


@contextlib.contextmanager
def attention_implementation_set(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Within the block, the model's text config dispatches to the registered implementation `name`."""
    text_config = model.config.get_text_config()
    base = text_config._attn_implementation
    text_config._attn_implementation = name
    try:
        yield
    finally:
        text_config._attn_implementation = base


# ------------------------------------------------------------------------------------------------------------------
# Reward sources the trainer adds after TRL's setup (T-GRPO's bonus columns)
# ------------------------------------------------------------------------------------------------------------------

def add_reward_source(trainer: Any, func: Callable, name: str, weight: float = 1.0) -> None:
    """Append a reward source after GRPOTrainer.__init__, the way TRL appends an environment's `get_reward` (its
    four parallel lists: functions, names, processing classes, weights), so TRL computes, gathers, sums and logs it
    like the user's."""
    trainer.reward_funcs.append(func)
    trainer.reward_func_names.append(name)
    trainer.reward_processing_classes.append(None)
    trainer.reward_weights = torch.cat([trainer.reward_weights, torch.tensor([weight], dtype=torch.float32)])


def decode_completions(trainer: Any, prompts: list, prompt_ids: list[list[int]], completion_ids: list[list[int]]
                       ) -> list:
    """Completions as TRL's `_generate` hands them to reward functions (its "Decode completions" block, without
    tools): conversational prompts get `[{"role": "assistant", "content": ...}]` (through `parse_response` where the
    tokenizer has a response template or schema), plain prompts the decoded text."""
    from trl.chat_template_utils import parse_response
    from trl.data_utils import is_conversational

    if prompts and is_conversational({"prompt": prompts[0]}):
        tokenizer = trainer._tokenizer
        if (getattr(tokenizer, "response_template", None) is not None
                or getattr(tokenizer, "response_schema", None) is not None):
            return [[parse_response(tokenizer, ids, prefix=prompt_ids[i], tools=trainer.tools)]
                    for i, ids in enumerate(completion_ids)]
        contents = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        return [[{"role": "assistant", "content": content}] for content in contents]
    return trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)


def trl_per_token_logps(trainer: Any, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        logits_to_keep: int) -> torch.Tensor:
    """TRL's own per-token log-prob pass (`GRPOTrainer._get_per_token_logps_and_entropies`, full sequences), not
    the trainer's override: the exactness audit's plain reference for text rows (trainers/verify.py)."""
    return trl.GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, attention_mask,
                                                              logits_to_keep)[0]

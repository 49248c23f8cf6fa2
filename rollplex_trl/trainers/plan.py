"""One decision, made once when the trainer is built, identical on every rank: what Rollplex does for this run,
what it leaves to TRL, and why.

Every "is this supported?" question is answered here from the configuration alone (never from timing or data), so
the answer is the same on every process and in every run with the same configuration. The trainer's components
read the `Support` object; none decides on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollplex_trl.config import rollplex_options
from rollplex_trl.data.prepared import check_first_media, check_prompt_format, has_video_column
from rollplex_trl.trainers.media import media_options

logger = logging.getLogger(__name__)

# Decoders whose prefix/suffix split is implemented and tested (full attention, RoPE or M-RoPE).
PREFIX_MODEL_TYPES = ("qwen2", "qwen2_5_vl", "llama")


@dataclass(frozen=True)
class Support:
    """What this run does, decided once, from the configuration. `notices` are logged once by the main process.

    Frozen: the one choice that depends on data, whether sharing the prefix pays under rollplex_share_prefix="auto",
    is not made here but once at the first rollout (prefix/cost.py `SharingDecision`, logged once); the trainer's
    `sharing.on` (trainers/sharing.py) combines the two."""

    share_scoring: bool  # reference/old log-probs from each prompt's prefix computed once
    share_actor: bool  # the loss pass's prefix once per prompt per accumulation window
    average_actor_gradients: bool  # multi-process DDP: the trainer averages the actor window's gradients itself
    prepare_images: bool  # image datasets take the prepared-prompt path (per-prompt identity for sharing)
    overlap_window: bool  # a rollout window exists to run prefix jobs in (concurrently or right after decoding)
    shared_prefill: bool  # the transformers rollout prefills each prompt once for its G samples
    notices: tuple[str, ...] = field(default=())


def decide_support(*, options: dict[str, Any], model_type: str | None, aux_loss: bool, has_tools: bool,
                   custom_rollout: bool, sharded: bool, num_processes: int, is_vlm: bool, use_vllm: bool,
                   continuous_batching: bool, num_beams: int, backend: str = "hf") -> Support:
    """The decision from the configuration. Raises where the user forced ("on") something that cannot run.

    Sharing the prefix is exact where: the decoder is one we know (full attention, Qwen2/Qwen2.5-VL/Llama family),
    no MoE aux loss is needed (the suffix pass does not return it), completions carry no tool outputs, and
    DeepSpeed/FSDP are off (their parameter gathers run in the wrapper's forward, which the prefix/suffix passes
    bypass). Under multi-process DDP the actor pass bypasses DDP's forward too, so the trainer averages its
    gradients itself once per window, which is what DDP computes.
    """
    notices: list[str] = []
    share_mode, overlap_mode = options["rollplex_share_prefix"], options["rollplex_overlap"]
    blockers = []
    if model_type not in PREFIX_MODEL_TYPES:
        blockers.append(f"model type {model_type!r} is not one of {PREFIX_MODEL_TYPES}")
    if aux_loss:
        blockers.append("the MoE router aux loss is not returned by the suffix pass")
    if has_tools:
        blockers.append("tool/environment turns put non-model tokens (and images) inside completions")
    if sharded:
        blockers.append("DeepSpeed/FSDP shard parameters; the prefix pass would run outside their gather hooks")
    share = share_mode != "off" and not blockers
    megatron = backend == "megatron"
    if share_mode != "off" and blockers:
        message = f"rollplex_share_prefix: off: {'; '.join(blockers)}"
        if share_mode == "on":
            raise ValueError(message + " (set rollplex_share_prefix='auto' or 'off')")
        notices.append(message)

    no_window = []
    if not share:
        no_window.append("the shared prefix is off")
    if continuous_batching:
        no_window.append("transformers' continuous batching has no decode window to run prefix work in")
    if no_window and overlap_mode != "off":
        message = f"rollplex_overlap: off: {'; '.join(no_window)}"
        if overlap_mode == "on":
            raise ValueError(message + " (set rollplex_overlap='auto' or 'off')")
        notices.append(message)

    shared_prefill = share and not use_vllm and not continuous_batching
    if shared_prefill and num_beams > 1:
        shared_prefill = False
        notices.append(f"rollplex: shared prefill off for generation (num_beams={num_beams}): beam search expands "
                       "the batch inside generate; prefix work is computed when scored")
    # The actor window's DDP averaging: the Megatron backend averages its own gradients over the DP group
    return Support(
        share_scoring=share, share_actor=share, average_actor_gradients=share and num_processes > 1 and not megatron,
        prepare_images=share and is_vlm and not has_tools and not custom_rollout,
        # beams: generate runs TRL's path without our window (the scoring passes compute the prefixes themselves)
        overlap_window=not no_window and (use_vllm or shared_prefill),  # needs `share`: no_window says so
        shared_prefill=shared_prefill, notices=tuple(notices))


def log_notices(support: Support, is_main_process: bool, warn: Callable[[str], None] = logger.warning) -> None:
    if is_main_process:
        for notice in support.notices:
            warn(notice)


def refuse_before_setup(arguments: dict[str, Any]) -> None:
    """Refuse combinations we cannot run before GRPOTrainer's setup connects to a vLLM server or loads weights.

    `arguments` are GRPOTrainer.__init__'s, by name.
    """
    evals = arguments.get("eval_dataset")
    datasets = {"train": arguments.get("train_dataset"),
                **({f"eval[{k}]": v for k, v in evals.items()} if isinstance(evals, dict) else {"eval": evals})}
    for name, dataset in datasets.items():
        check_prompt_format(dataset, name)
    config = arguments.get("args")
    if config is None:
        return
    options = rollplex_options(config)
    if not options["rollplex_skip_invalid_samples"]:
        sampling = media_options(options, None, None).sampling
        for name, dataset in datasets.items():
            check_first_media(dataset, name, sampling, options["rollplex_check_rows"])
    returned = (getattr(config, "generation_kwargs", None) or {}).get("num_return_sequences", 1) or 1
    if returned > 1:
        # GRPO draws num_generations completions per prompt itself; generate returning several per row would
        # misalign every row after it (TRL's own path then fails deep inside with a tensor-size error)
        raise ValueError(f"generation_kwargs sets num_return_sequences={returned}: GRPO draws num_generations "
                         "completions per prompt itself. Remove num_return_sequences and set num_generations instead.")
    if not (config.use_vllm and config.vllm_mode == "server"):
        return
    for name, dataset in datasets.items():
        if dataset is not None and has_video_column(dataset):
            raise NotImplementedError(
                f"the {name} dataset has videos, but vllm_mode='server' cannot carry them: TRL's server protocol "
                "sends images only. Use vllm_mode='colocate' (or use_vllm=False) for video prompts."
            )

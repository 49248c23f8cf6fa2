"""The run plan: one decision, made once when the trainer is built, identical on every rank: what Rollplex does
for this run, what it leaves to TRL, and why.

`plan_run(options, facts)` is a pure function from the `rollplex_*` options and the trainer's `RunFacts` (model,
backend, rollout engine, accelerate state) to a frozen `RunPlan`. Every "is this supported?" question of the
trainer's components is answered there (never from timing), so the answer is the same on every process and in every
run with the same configuration; the components read the plan, none decides on its own. The checks that must run
before TRL's setup loads weights or connects to vLLM (`refuse_before_setup`) are here too.

What is decided elsewhere, and why: the one data-dependent choice (whether sharing pays, `RunPlan.sharing_pays`,
at the first rollout); a `generate` call's own keyword arguments (prefix/generation.py: shared-prefix decoding falls
back per call under "auto"); and the Megatron backend's engine switches, which need its built model
(backends/megatron/backend.py, refused at construction).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rollplex_trl.config import rollplex_options
from rollplex_trl.data.prepared import (
    check_first_media,
    check_first_prompts,
    check_prompt_format,
    first_video_rows,
    has_video_column,
)
from rollplex_trl.models.families import SHARED_PREFIX_MODEL_TYPES
from rollplex_trl.notices import notice
from rollplex_trl.prefix.suffix_attention import MODES as SUFFIX_MODES
from rollplex_trl.trainers.media import media_options
from rollplex_trl.trainers.memory import KeptResident
from rollplex_trl.trainers.verify import AuditSpec, audit_spec

# Decoders whose prefix/suffix split is implemented and tested (full attention, RoPE or M-RoPE).
PREFIX_MODEL_TYPES = SHARED_PREFIX_MODEL_TYPES  # (models/families.py)


@dataclass(frozen=True)
class RunFacts:
    """What the plan is decided from: the trainer's setup, read once (`RunFacts.of`). Plain values only, so
    `plan_run` is a pure function of (options, facts) and tests can state any situation without building a trainer."""

    model_type: str | None
    aux_loss: bool  # MoE router aux loss requested
    has_tools: bool  # tools or environments: completions carry non-model turns
    custom_rollout: bool  # a user rollout_func
    sharded: bool  # DeepSpeed or FSDP
    num_processes: int
    is_vlm: bool
    use_vllm: bool
    continuous_batching: bool
    num_beams: int
    num_generations: int
    reward_func_names: tuple[str, ...] = ()
    backend: str = "hf"
    cascade_unsupported: str | None = None  # why the cascade suffix attention cannot run (backend.cascade_unsupported)
    memory_unsupported: str | None = None  # why rollplex_memory cannot act at all (PhaseMemory.unsupported)
    memory_kept: tuple[KeptResident, ...] = ()  # what rollplex_memory would move but cannot here
    memory_pays: tuple[bool, str] = (False, "")  # rollplex_memory="auto": whether the moves pay, and why

    @classmethod
    def of(cls, trainer: Any) -> RunFacts:
        """The facts of a constructed trainer (after TRL's setup and the backend's construction)."""
        from rollplex_trl import trl_compat
        from rollplex_trl.prefix import unwrap_model
        from rollplex_trl.trainers.memory import PhaseMemory

        model = trainer.accelerator.unwrap_model(trainer.model)
        generation_config = getattr(trainer, "generation_config", None)
        memory_on = trainer.rollplex.get("rollplex_memory", "off") != "off"
        memory_unsupported = PhaseMemory.unsupported(trainer) if memory_on else None
        usable = memory_on and memory_unsupported is None
        return cls(
            model_type=getattr(model.config, "model_type", None), aux_loss=bool(trainer.aux_loss_enabled),
            has_tools=bool(trainer.tools) or trainer.environment_factories is not None,
            custom_rollout=trainer.rollout_func is not None,
            sharded=bool(trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled),
            num_processes=trainer.accelerator.num_processes, is_vlm=trl_compat.is_vlm(trainer),
            use_vllm=bool(trainer.use_vllm), continuous_batching=bool(trainer.use_transformers_continuous_batching),
            num_beams=getattr(generation_config, "num_beams", 1) or 1, num_generations=trainer.num_generations,
            reward_func_names=tuple(trainer.reward_func_names), backend=trainer.backend.name,
            cascade_unsupported=trainer.backend.cascade_unsupported(unwrap_model(model), trainer.accelerator.device),
            memory_unsupported=memory_unsupported,
            memory_kept=tuple(PhaseMemory.kept_resident(trainer)) if usable else (),
            memory_pays=PhaseMemory.pays(trainer) if usable and trainer.rollplex["rollplex_memory"] == "auto"
            else (False, ""))


@dataclass(frozen=True)
class RunPlan:
    """What this run does, decided once (`plan_run`). `notices` are logged once by the main process.

    Frozen. The one choice that depends on data, whether sharing the prefix pays under rollplex_share_prefix="auto",
    is the explicit field `sharing_pays`: None until the first rollout decides it (prefix/cost.py `SharingDecision`,
    logged once), then set once by `decided_sharing` (a new plan; this one is never modified)."""

    share_scoring: bool  # reference/old log-probs from each prompt's prefix computed once
    share_actor: bool  # the loss pass's prefix once per prompt per accumulation window
    average_actor_gradients: bool  # multi-process DDP: the trainer averages the actor window's gradients itself
    prepare_images: bool  # image datasets take the prepared-prompt path (per-prompt identity for sharing)
    overlap_window: bool  # a rollout window exists to run prefix jobs in (concurrently or right after decoding)
    shared_prefill: bool  # the transformers rollout prefills each prompt once for its G samples
    suffix_attention: str = "concat"  # "cascade" (prompt K/V shared) or "concat" (copied per row)
    audit: AuditSpec = AuditSpec(every=0, rows=0, strict=False)  # the exactness audit (trainers/verify.py)
    temporal: bool = False  # T-GRPO's shuffled rollouts and bonus
    len_control: bool = False  # Video-R1's length bonus
    temporal_reward_index: int = 0  # which reward function is the accuracy T-GRPO and length control read
    memory: bool = False  # rollplex_memory acts (trainers/memory.py `PhaseMemory`)
    memory_reason: str = ""  # why it acts ("on", or auto's measurement)
    memory_kept: tuple[KeptResident, ...] = ()  # what it would move but keeps resident
    sharing_pays: bool | None = None  # data decision of rollplex_share_prefix="auto": None until the first rollout
    notices: tuple[str, ...] = field(default=())

    def decided_sharing(self, pays: bool) -> RunPlan:
        """This plan with the first rollout's data decision filled in (made once: a second call is an error)."""
        if self.sharing_pays is not None:
            raise RuntimeError("internal error: the sharing decision is made once")
        return replace(self, sharing_pays=pays)


def plan_run(options: dict[str, Any], facts: RunFacts) -> RunPlan:
    """The plan for `options` (rollplex_options of the config) and `facts`. Every refusal of a combination is here:
    a switch the user forced "on" that cannot hold raises; "auto" falls back with a notice (logged once).

    Sharing the prefix is exact where: the decoder is one we know (full attention, Qwen2/Qwen2.5-VL/Llama family),
    no MoE aux loss is needed (the suffix pass does not return it), completions carry no tool outputs, and
    DeepSpeed/FSDP are off (their parameter gathers run in the wrapper's forward, which the prefix/suffix passes
    bypass). Under multi-process DDP the actor pass bypasses DDP's forward too, so the trainer averages its
    gradients itself once per window, which is what DDP computes.
    """
    notices: list[str] = []
    share_mode, overlap_mode = options["rollplex_share_prefix"], options["rollplex_overlap"]
    blockers = []
    if facts.model_type not in PREFIX_MODEL_TYPES:
        blockers.append(f"model type {facts.model_type!r} is not one of {PREFIX_MODEL_TYPES}")
    if facts.aux_loss:
        blockers.append("the MoE router aux loss is not returned by the suffix pass")
    if facts.has_tools:
        blockers.append("tool/environment turns put non-model tokens (and images) inside completions")
    if facts.sharded:
        blockers.append("DeepSpeed/FSDP shard parameters; the prefix pass would run outside their gather hooks")
    share = share_mode != "off" and not blockers
    megatron = facts.backend == "megatron"
    if share_mode != "off" and blockers:
        message = f"rollplex_share_prefix: off: {'; '.join(blockers)}"
        if share_mode == "on":
            raise ValueError(message + " (set rollplex_share_prefix='auto' or 'off')")
        notices.append(message)

    no_window = []
    if not share:
        no_window.append("the shared prefix is off")
    if facts.continuous_batching:
        no_window.append("transformers' continuous batching has no decode window to run prefix work in")
    if no_window and overlap_mode != "off":
        message = f"rollplex_overlap: off: {'; '.join(no_window)}"
        if overlap_mode == "on":
            raise ValueError(message + " (set rollplex_overlap='auto' or 'off')")
        notices.append(message)

    shared_prefill = share and not facts.use_vllm and not facts.continuous_batching
    if shared_prefill and facts.num_beams > 1:
        shared_prefill = False
        notices.append(f"shared prefill off for generation (num_beams={facts.num_beams}): beam search "
                       "expands the batch inside generate; prefix work is computed when scored")
    temporal, len_control, reward_index = _temporal_plan(options, facts)
    memory, memory_reason, memory_kept = _memory_plan(options, facts, notices)
    return RunPlan(
        share_scoring=share, share_actor=share, average_actor_gradients=share and facts.num_processes > 1
        and not megatron,  # the Megatron backend averages its own gradients over the DP group
        prepare_images=share and facts.is_vlm and not facts.has_tools and not facts.custom_rollout,
        # beams: generate runs TRL's path without our window (the scoring passes compute the prefixes themselves)
        overlap_window=not no_window and (facts.use_vllm or shared_prefill),  # needs `share`: no_window says so
        shared_prefill=shared_prefill,
        suffix_attention=_suffix_attention(options["rollplex_suffix_attention"], facts, share, notices),
        audit=audit_spec(options, num_generations=facts.num_generations, backend=facts.backend),
        temporal=temporal, len_control=len_control, temporal_reward_index=reward_index,
        memory=memory, memory_reason=memory_reason, memory_kept=memory_kept, notices=tuple(notices))


def _suffix_attention(mode: str, facts: RunFacts, share: bool, notices: list[str]) -> str:
    """"cascade" wherever it applies under "auto"; "cascade" forced where it cannot apply raises."""
    if mode not in SUFFIX_MODES:
        raise ValueError(f"rollplex_suffix_attention must be one of {SUFFIX_MODES}, got {mode!r}")
    if not share or mode == "concat":
        return "concat"
    reason = facts.cascade_unsupported
    if reason is None:
        return "cascade"
    if mode == "cascade":
        raise ValueError(f"rollplex_suffix_attention='cascade' cannot run here: {reason} (use 'auto' or 'concat')")
    if facts.backend == "hf":  # the Megatron backend's suffix pass is its own: not a fallback to report
        notices.append(f"rollplex_suffix_attention=auto: concat (the prompt's K/V copied per row): {reason}")
    return "concat"


def _temporal_plan(options: dict[str, Any], facts: RunFacts) -> tuple[bool, bool, int]:
    """(T-GRPO on, length control on, index of the accuracy reward function) for trainers/temporal.py."""
    temporal, len_control = bool(options["rollplex_temporal"]), bool(options["rollplex_len_control"])
    if temporal and facts.backend == "megatron":
        raise NotImplementedError("rollplex_temporal=True with rollplex_backend='megatron': the shuffled rollout "
                                  "is not wired into the Megatron backend's rollout yet. Use the 'hf' backend.")
    if temporal and (facts.has_tools or facts.custom_rollout):
        raise NotImplementedError("rollplex_temporal=True with tools, environments or a rollout_func: the "
                                  "shuffled copies are sampled by the trainer's own single-turn rollout. Turn "
                                  "rollplex_temporal off, or drop the custom rollout.")
    wanted = options["rollplex_temporal_reward"]
    names = list(facts.reward_func_names)
    if (temporal or len_control) and wanted and wanted not in names:
        raise ValueError(f"rollplex_temporal_reward={wanted!r} names no reward function; the trainer's are "
                         f"{names}. Give one of them, or '' for the first.")
    return temporal, len_control, names.index(wanted) if wanted and wanted in names else 0


def _memory_plan(options: dict[str, Any], facts: RunFacts, notices: list[str]
                 ) -> tuple[bool, str, tuple[KeptResident, ...]]:
    """(acts, why, what stays resident) for rollplex_memory. A forced "on" is never silently weakened: what it
    cannot move raises here, naming the setting that would."""
    mode = options.get("rollplex_memory", "off")
    if mode == "off":
        if options.get("rollplex_offload_activations", "auto") == "on":
            raise ValueError("rollplex_offload_activations='on' acts through the phase memory: set "
                             "rollplex_memory='on' (or 'auto') as well, or rollplex_offload_activations='auto'")
        return False, "", ()
    if facts.memory_unsupported is not None:
        if mode == "on":
            raise ValueError(f"rollplex_memory='on' cannot act here: {facts.memory_unsupported}. Use 'auto' or 'off'.")
        notices.append(f"rollplex_memory='auto': off, {facts.memory_unsupported}")
        return False, "", ()
    kept = facts.memory_kept
    if mode == "on":
        if kept:
            raise ValueError("; ".join(k.refusal() for k in kept))
        return True, "rollplex_memory='on'", kept
    pays, why = facts.memory_pays
    stays = "".join(f"; the {k.what} stays resident ({k.reason})" for k in kept)
    notices.append(f"rollplex_memory='auto': {'on' if pays else 'off'}, {why}{stays}")
    return pays, why, kept


def log_notices(plan: RunPlan, is_main_process: bool, warn: Callable[[str], None] = notice) -> None:
    if is_main_process:
        for notice in plan.notices:
            warn(notice)


def _processor_for_checks(arguments: dict[str, Any]) -> Any:
    """The processor TRL will use (the one passed, else the model's, as GRPOTrainer loads it), or None if it cannot
    be loaded here: then the check waits for the first step, and TRL's own loading reports the path."""
    processor = arguments.get("processing_class")
    model = arguments.get("model")
    path = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
    if processor is None and path:
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(path)
        except (OSError, ValueError):
            return None
    # a tokenizer (a text model given video rows) is refused by the trainer's own check, with its own message
    return processor if getattr(processor, "tokenizer", None) is not None else None


def refuse_before_setup(arguments: dict[str, Any]) -> None:
    """Refuse combinations we cannot run, and data we cannot train on, before GRPOTrainer's setup connects to a vLLM
    server or loads weights: prompt formats, the first `rollplex_check_rows` rows' media files, and the same rows
    through the processor and the prompt budget.

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
        rows = options["rollplex_check_rows"]
        with_video = {name: first_video_rows(d, rows) for name, d in datasets.items()}
        with_video = {name: found for name, found in with_video.items() if found}
        processor = _processor_for_checks(arguments) if with_video else None
        # the frames are checked as training will sample them (the processor's settings where it says so)
        media = media_options(options, None, getattr(config, "chat_template_kwargs", None), processor=processor)
        for name, dataset in datasets.items():
            check_first_media(dataset, name, media.sampling, options["rollplex_check_rows"])
        for name, found in with_video.items() if processor is not None else ():
            check_first_prompts(found, name, processor, media, rows)
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

"""`TrainerRollout`: the rollout of one generation batch at θ_k, as `RollplexGRPOTrainer` runs it.

`run` (this rank decodes) and `peer` (a pooled rollout's rank that does not decode) are what the backend's
`generate` calls (backends/base.py). Each starts the step's `StepPrefixes` and then:

- with vLLM: the engine decodes (rollout/trl_vllm.py) inside the decode window;
- with transformers: the engine `TransformersRollout` (rollout/transformers_rollout.py) runs TRL's generation with
  the **shared prefill** (prefix/generation.py): each unique prompt prefilled once for its G samples, kept for the
  actor window where the actor's prefix is due at these weights (`PrefillForActor`), the decode window opened
  around the decode steps;
- otherwise (continuous batching, beams, TRL's own image path): TRL's `_generate_single_turn`, unchanged.

The **decode window** runs the prefix jobs (overlap/schedule.py `PrefixJobs`: reference, old policy, actor) at the
same weights, during decoding or right after it; their states go into the step's `StepPrefixes`.

The component reads the trainer's state (models, accelerator, options, the other components); it keeps none of
its own between rollouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from rollplex_trl import trl_compat
from rollplex_trl.data.prompt import PreparedPrompt, generation_fields
from rollplex_trl.overlap import PrefixJobs
from rollplex_trl.prefix.batch import StepPrefixes
from rollplex_trl.prefix.generation import BackendPrefill, PrefillForActor, prefill_for_rollout
from rollplex_trl.rollout.sampled_logps import SampledLogps
from rollplex_trl.rollout.transformers_rollout import TransformersRollout

# TRL's `_generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)`
TrlGenerate = Callable[..., Any]


class TrainerRollout:
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.transformers = TransformersRollout(trainer)  # the transformers rollout engine

    # ---- the two sides of a rollout ------------------------------------------------------------------------------

    def run(self, prompt_ids: list[list[int]], images: Any, multimodal_fields: Any, num_generations: int,
            has_tool_images: bool, trl_generate: TrlGenerate, pool: Any = None) -> tuple[list[list[int]], Any]:
        """This rank decodes: (completion ids, sampling log-probs)."""
        t = self.trainer
        t._decide_sharing(prompt_ids)
        t.batch.prefixes = StepPrefixes()  # this rollout's: nothing an earlier one built serves it
        rows = t.batch.generation_rows
        if t.vllm_rollout is not None:
            (completion_ids, logprobs), step = t.vllm_rollout.generate(
                prompt_ids, images, rows, num_generations, weights_step=t.state.global_step,
                synced_step=trl_compat.last_loaded_step(t), decode_window=self.decode_window(rows),
                record=t._record, trainer=t)
            trl_compat.set_last_loaded_step(t, step)
            return completion_ids, logprobs
        # Continuous batching has its own prefix caching; TRL's own image path has no per-prompt identity.
        if not self.takes_shared_prefill(images, rows, num_generations, has_tool_images):
            return trl_generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

        def log(rows_count: int, prompts: int) -> None:
            t._record("rollplex/prefill_rows_per_prompt", rows_count / max(1, prompts))

        checkpointing = self.training_checkpointing()
        for_actor = PrefillForActor(wanted=self.actor_from_prefill, into=t.batch.prefixes,
                                    checkpointing=checkpointing)
        window = self.decode_window(rows, checkpointing)
        sampled = self.sampler_audit()
        completion_ids = self.transformers.generate(
            prompt_ids, rows, num_generations, multimodal_fields=multimodal_fields, on_prefill=log,
            decode_window=pool.window(window) if pool is not None else window, for_actor=for_actor,
            sampled_logps=sampled, **self.engine_options())
        if sampled is not None:  # for the audit only: TRL's regular generation returns no sampling log-probs
            t.batch.sampler_logps = sampled.result
        return completion_ids, None

    def peer(self, prompt_ids: list[list[int]], images: Any, num_generations: int, has_tool_images: bool,
             pool: Any) -> None:
        """A TP peer's side of a pooled rollout (backends/megatron/pooled_rollout.py): the same decisions and
        decode window as the first rank's `run`, waiting where it decodes."""
        t = self.trainer
        t._decide_sharing(prompt_ids)
        t.batch.prefixes = StepPrefixes()
        rows = t.batch.generation_rows
        if not self.takes_shared_prefill(images, rows, num_generations, has_tool_images):
            pool.wait()
            return
        input_ids, attention_mask = trl_compat.generation_prompt_tensors(t, prompt_ids)
        checkpointing = self.training_checkpointing()
        prefill = self.backend_prefill()
        if prefill is not None:  # the first rank's prefill is a TP collective: run it alongside, keep it alike
            for_actor = PrefillForActor(wanted=self.actor_from_prefill, into=t.batch.prefixes,
                                        checkpointing=checkpointing)
            prefill_for_rollout(prefill, input_ids, attention_mask, rows, for_actor=for_actor,
                                forward_context=t.accelerator.autocast)
        window = self.decode_window(rows, checkpointing)
        if window is None:
            pool.wait()
            return
        with window(input_ids, attention_mask):
            pool.wait()

    def extra_samples(self, prompt_ids: list[list[int]], rows: list[PreparedPrompt], num_generations: int,
                      trl_generate: TrlGenerate) -> list[list[int]]:
        """Completion ids for extra rows sampled at the same weights after the step's rollout (T-GRPO's shuffled
        copies, trainers/temporal.py): the same engine (vLLM, or `TransformersRollout` with the shared prefill and
        shared-prefix decode), but no decode window, no prefix jobs and no prefix kept for the actor: these rows are
        scored, never trained on. The engine's weights are already this step's (the rollout just synced them)."""
        t = self.trainer
        fields = generation_fields(rows)
        if t.vllm_rollout is not None:
            (completion_ids, _), _ = t.vllm_rollout.generate(
                prompt_ids, None, rows, num_generations, weights_step=t.state.global_step,
                synced_step=trl_compat.last_loaded_step(t), decode_window=None, record=lambda key, value: None,
                trainer=t)
            return completion_ids
        if not self.takes_shared_prefill(None, rows, num_generations, False):
            return trl_generate(prompt_ids, None, fields, num_generations, False)[0]
        return self.transformers.generate(prompt_ids, rows, num_generations, multimodal_fields=fields,
                                          **self.engine_options())

    # ---- decisions ------------------------------------------------------------------------------------------------

    def takes_shared_prefill(self, images: Any, rows: list[PreparedPrompt] | None, num_generations: int,
                             has_tool_images: bool) -> bool:
        """Whether the transformers rollout prefills each prompt once, which is where its decode window opens."""
        return not (not self.trainer.plan.shared_prefill or num_generations < 2 or has_tool_images
                    or (rows is None and images is not None))

    def actor_from_prefill(self) -> bool:
        """Whether this rollout's shared prefill can be the actor window's prefix: the window is this generation's
        (no optimizer step between them, so the weights are the same), the actor's prefix would be built from the
        same forward (the prefill runs under the trainer's autocast, as TRL's generate and the actor's job do, and,
        when kept, checkpointed as training checkpoints; no phase memory, whose activation offload wraps the actor's
        prefix job), and the prefill runs the policy: the transformers model that decodes, or on the Megatron
        backend its policy's prefix pass (`backend_prefill`)."""
        t = self.trainer
        return (t.model.training and t.actor_window is not None and t.phase_memory is None
                and t.backend.prefill_serves_actor(training=t.model.training) and self.policy_prefix_jobs().actor)

    def sampler_audit(self) -> SampledLogps | None:
        """On a training step the exactness audit checks: a recorder of the transformers sampler's own log-probs of
        the audited rows (rollout/sampled_logps.py), compared with a plain pass by `audit_sampler`. The `hf` backend
        only: on Megatron a pooled rollout decodes on one rank of each TP group, and the audit's reduction needs every
        rank to check."""
        t = self.trainer
        audit = t.audit
        if (audit is None or t.backend.name != "hf" or not t.model.training
                or not audit.wants(t.state.global_step, "sampler")):
            return None
        return SampledLogps(rows=audit.spec.rows, temperature=t.temperature)

    def engine_options(self) -> dict[str, Any]:
        """The transformers engine's options that every rollout of this trainer shares."""
        t = self.trainer
        return {"shared_decode": t.rollplex["rollplex_shared_decode"],
                "compile_decode": t.rollplex["rollplex_compile_decode"], "decode_context": self.decode_weight_casts,
                "prefill": self.backend_prefill(), "video_store": t.batch.video_store}

    def backend_prefill(self) -> BackendPrefill | None:
        """How the transformers rollout prefills (`generate_with_shared_prefill(prefill=)`): None for the decoding
        model's own layers; on the Megatron backend its policy's prefix pass where that applies."""
        return self.trainer.backend.rollout_prefill(training=self.trainer.model.training)

    def decode_weight_casts(self) -> contextlib.AbstractContextManager:
        """Entered around the decode steps, inside the decode window: under autocast the rollout model's frozen
        weights are cast once per `generate` call instead of at every step (rollout/weight_casts.py); not while a
        job building a graph on the policy runs concurrently (the overlap's actor job)."""
        t = self.trainer
        if t.accelerator.mixed_precision == "no":
            return contextlib.nullcontext()
        return t.backend.decode_weight_casts(
            t.accelerator.unwrap_model(t.model), sharded=t.is_deepspeed_enabled or t.is_fsdp_enabled,
            concurrent_graph_job=t.overlap is not None and t.overlap.graph_job_running)

    # ---- the decode window and its prefix jobs ----------------------------------------------------------------------

    def decode_window(self, rows: list[PreparedPrompt] | None, checkpointing: Callable | None = None
                      ) -> Callable | None:
        """The decode-window context for the transformers / vLLM rollout, or None without an overlap schedule.
        `checkpointing`: a `training_checkpointing()` taken before generation (taken here if None)."""
        t = self.trainer
        if t.overlap is None:
            return None
        weights = [*t.model.parameters(), *(t.ref_model.parameters() if t.ref_model is not None else []),
                   *t.backend.window_weights()]
        checkpointing = checkpointing or self.training_checkpointing()

        def window(input_ids: torch.Tensor, attention_mask: torch.Tensor):
            jobs = self.prefix_jobs(checkpointing).for_window(input_ids, attention_mask, rows,
                                                              training=t.model.training)
            if t.batch.prefixes.actor is not None:
                jobs = [(name, job) for name, job in jobs if name != "actor"]  # the prefill already built it
            return t.overlap.window(jobs, weights, training=t.model.training, into=t.batch.prefixes)

        return window

    def prefix_jobs(self, actor_checkpointing: Callable = contextlib.nullcontext) -> PrefixJobs:
        jobs = dataclasses.replace(self.policy_prefix_jobs(), actor_checkpointing=actor_checkpointing)
        # the reference prefix job runs in the decode window: the reference weights resident only while it runs
        memory = self.trainer.phase_memory
        return memory.prefix_jobs(jobs) if memory is not None else jobs

    def policy_prefix_jobs(self) -> PrefixJobs:
        t = self.trainer
        policy = t.accelerator.unwrap_model(t.model)
        is_peft = hasattr(policy, "peft_config")
        # TRL's own condition for computing old log-probs (GRPOTrainer._generate_and_score_completions)
        generate_every = t.args.steps_per_generation * t.num_iterations
        needs_old = (t.args.gradient_accumulation_steps % generate_every != 0
                     or (t.use_vllm and t.vllm_importance_sampling_correction))
        window_is_generation = (t.args.steps_per_generation == t.args.gradient_accumulation_steps
                                and t.num_iterations == 1)
        ref = t.accelerator.unwrap_model(t.ref_model) if t.beta != 0.0 and t.ref_model is not None else None
        policy, ref, backend = t.backend.prefix_job_models(policy, ref, training=t.model.training)
        # PEFT: the old pass would run the policy while its adapters are toggled for the reference (module state)
        return PrefixJobs(policy=policy, ref_model=ref, old=needs_old and not is_peft,
                          actor=t.sharing.on and window_is_generation, autocast=t.accelerator.autocast,
                          prompts_per_chunk=t.rollplex["rollplex_prefix_chunk_prompts"], **backend)

    def training_checkpointing(self) -> Callable[[], contextlib.AbstractContextManager]:
        """A context factory: the policy's gradient checkpointing as it is now, restored inside the block. Taken
        before generation starts: TRL's generation context turns checkpointing off for the whole rollout, and the
        actor's prefix, built inside it (the decode window's job or the kept prefill), must checkpoint as the
        training forward does (on Megatron: the vision tower, the HF module; its LLM has its own recompute)."""
        state = trl_compat.checkpointing_state(self.trainer.accelerator.unwrap_model(self.trainer.model))
        return functools.partial(trl_compat.checkpointing_as, state)

"""`RollplexGRPOTrainer`: TRL's GRPOTrainer, plus video and the Rollplex schedule, as components it owns.

One training step, top to bottom (each TRL override below is a few lines that hand over to a component):

    _generate_and_score_completions   prepared rows of the generation batch -> `batch.generating(rows)`
      _tokenize_prompts               token ids and vision tensors from the prepared prompts
      _generate_single_turn           `backend.generate` -> `rollout.run`: vLLM or transformers' generate with the
                                      shared prefill; the prefix jobs run in its decode window (`overlap`) and fill
                                      the step's `batch.prefixes`
      (TRL: rewards, advantages)
      _get_per_token_logps_and_entropies   old/ref log-probs: `backend.logps_and_entropies`, suffixes only
    training_step / compute_loss      the actor: `backend.actor_suffix_logps` against the accumulation window's
                                      prefix (`actor_window`), one prefix backward at its end; TRL's loss unchanged
    (optimizer step)                  after `overlap.assert_idle()`: no θ_k reader is left

The components (docs/architecture.md): `plan` (what this run does, decided once: trainers/plan.py), `backend` (the
engine that trains the policy: backends/), `sharing` (whether the shared prefix runs), `rollout`, `batch` (the
batch in flight and its `StepPrefixes`), `overlap`, `actor_window`, `vllm_rollout`, `media`, `phase_memory`,
`memory_ledger`, `checkpoint_staging`, `temporal` (T-GRPO), `audit` (the exactness audit). Third-party internals
are touched only in the compat modules. Batches without prepared prompts (text, or images without the shared prefix)
run TRL's code unchanged.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import torch
from trl import GRPOTrainer

from rollplex_trl import trl_compat
from rollplex_trl.backends import HfBackend, build_backend, refuse_backend_setup
from rollplex_trl.backends.base import TrainingBackend
from rollplex_trl.callbacks import NoLearningSignal, StartupBanner, TimelineImageCallback
from rollplex_trl.callbacks.console import use_compact_console
from rollplex_trl.config import rollplex_options
from rollplex_trl.data.prepared import PREPARED_KEY, VIDEO_COLUMNS
from rollplex_trl.data.prompt import PreparedPrompt, check_rows_match_ids, generation_fields
from rollplex_trl.notices import notice
from rollplex_trl.overlap import OverlapExecutor, OverlapSchedule, Span, Timeline
from rollplex_trl.prefix.actor import ActorWindow
from rollplex_trl.prefix.batch import StepPrefixes
from rollplex_trl.rollout.trl_vllm import RollplexVLLMGeneration, VLLMRollout
from rollplex_trl.trainers.checkpoint import (
    CheckpointStaging,
    ResumableRepeatSampler,
    load_model_weights,
    needs_converted_load,
    resolve_resume_argument,
)
from rollplex_trl.trainers.context import BatchContext
from rollplex_trl.trainers.media import DatasetPreparation, media_options, setup_video_training
from rollplex_trl.trainers.memory import PhaseMemory, setup_memory_ledger, vllm_sleep_for_memory
from rollplex_trl.trainers.plan import RunFacts, RunPlan, log_notices, plan_run, refuse_before_setup
from rollplex_trl.trainers.rewards import reject_non_finite_rewards
from rollplex_trl.trainers.rollout import TrainerRollout
from rollplex_trl.trainers.sharing import PrefixSharing
from rollplex_trl.trainers.temporal import TemporalRecipe
from rollplex_trl.trainers.verify import audit_pass, audit_sampler, build_audit

# Keyword arguments of TRL's `_get_per_token_logps_and_entropies` that carry vision inputs.
_TRL_VISION_KWARGS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                      "token_type_ids", "mm_token_type_ids", "image_position_ids")


class RollplexGRPOTrainer(GRPOTrainer):
    """Drop-in replacement for `trl.GRPOTrainer` that also trains on video (Qwen2.5-VL).

    Use it like `GRPOTrainer`; configure it with `RollplexGRPOConfig` (a `GRPOConfig` subclass; a plain
    `GRPOConfig` also works and gets the safe defaults of every `rollplex_*` field).
    """

    _tag_names = ["trl", "grpo", "rollplex"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.checkpoint_staging = CheckpointStaging()  # first: the Trainer's setup may ask for its output folder
        arguments = trl_compat.trainer_init_arguments(*args, **kwargs)
        refuse_before_setup(arguments)
        if arguments.get("args") is not None:
            from accelerate import PartialState

            refuse_backend_setup(arguments["args"], peft_config=arguments.get("peft_config"),
                                 world_size=PartialState().num_processes,
                                 train_dataset=arguments.get("train_dataset"))
        config = arguments.get("args")
        vllm_dtype = rollplex_options(config)["rollplex_vllm_dtype"]
        # rollplex_memory="on": vLLM's sleep mode, set before TRL builds the engine
        sleep_notice = vllm_sleep_for_memory(config, rollplex_options(config), cuda=torch.cuda.is_available()
                                             and not getattr(config, "use_cpu", False))
        # TRL builds its vLLM generation object inside __init__: ours stands in (same constructor and options)
        with trl_compat.trl_builds_vllm_generation(functools.partial(RollplexVLLMGeneration, vllm_dtype=vllm_dtype)):
            super().__init__(*args, **kwargs)
        self.rollplex = rollplex_options(self.args)
        self.backend: TrainingBackend = build_backend(self)
        self.plan: RunPlan = plan_run(self.rollplex, RunFacts.of(self))  # trainers/plan.py: every refusal is there
        self.backend.suffix_attention_mode = self.plan.suffix_attention
        log_notices(self.plan, self.accelerator.is_main_process)
        if sleep_notice is not None and self.accelerator.is_main_process:
            notice(sleep_notice)
        self.sharing = PrefixSharing.build(self)  # trainers/sharing.py: the suffix path, and auto's data decision
        self.batch = BatchContext()
        self.actor_window = ActorWindow(
            self.accelerator.autocast, trl_compat.pad_token_id(self),
            average_across_processes=self.plan.average_actor_gradients,
            on_built=lambda: self.memory_ledger.sample() if self.memory_ledger is not None else None,
            build_prefix=self.backend.build_actor_prefix(),
        ) if self.plan.share_actor else None
        self.overlap = self._build_overlap() if self.plan.overlap_window else None
        self.rollout = TrainerRollout(self)  # trainers/rollout.py
        self.timeline = self.overlap.timeline if self.overlap is not None else Timeline()
        generation = getattr(self, "vllm_generation", None)
        self.vllm_rollout = VLLMRollout(generation, trl_compat.pad_token_id(self), self.accelerator.device) if (
            self.use_vllm and isinstance(generation, RollplexVLLMGeneration)) else None
        self.media = DatasetPreparation(
            self.processing_class, media_options(self.rollplex, self.chat_template, self.chat_template_kwargs,
                                                 processor=self.processing_class),
            is_vlm=trl_compat.is_vlm(self), prepare_images=self.plan.prepare_images, framed=self.use_vllm,
            custom_rollout=bool(self.tools) or self.environment_factories is not None or self.rollout_func is not None)
        if self._wrap_datasets():
            setup_video_training(self)
        self.memory_ledger = setup_memory_ledger(self) if self.rollplex["rollplex_memory_ledger"] else None
        self.phase_memory = PhaseMemory.build(self)  # rollplex_memory (trainers/memory.py); None when off
        self.reward_funcs = [reject_non_finite_rewards(f, name)
                             for f, name in zip(self.reward_funcs, self.reward_func_names, strict=True)]
        self.temporal = TemporalRecipe.build(self)  # T-GRPO / length control (trainers/temporal.py); None when off
        self.audit = build_audit(self)  # rollplex_verify_every (trainers/verify.py); None when off
        for callback in (StartupBanner(self), NoLearningSignal()):  # the banner; a warning when nothing is learned
            self.add_callback(callback)
        if self.rollplex["rollplex_console"] == "compact":
            use_compact_console(self)  # one line per step; the dictionaries stay in the log history and trackers
        if self.rollplex["rollplex_timeline"] and not any(isinstance(c, TimelineImageCallback)
                                                          for c in self.callback_handler.callbacks):
            self.add_callback(TimelineImageCallback(self))  # the timeline as an image in image-taking trackers

    # ------------------------------------------------------------------------------------------------------------
    # Setup
    # ------------------------------------------------------------------------------------------------------------

    def _decide_sharing(self, prompt_ids: list[list[int]]) -> None:
        """The first rollout's (or scoring pass's) prompts make `auto`'s data decision once (trainers/sharing.py)."""
        self._sharing_decided(self.sharing.decide(prompt_ids))

    def _decide_sharing_from_mask(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        self._sharing_decided(self.sharing.decide_from_mask(prompt_ids, prompt_mask))  # a custom rollout_func's

    def _sharing_decided(self, pays: bool | None) -> None:
        """Record the data decision in the plan, once. Where sharing does not pay, the components serving it go
        (generation's shared prefill stays: it is always cheaper)."""
        if pays is None:
            return  # nothing was decided by this batch
        self.plan = self.plan.decided_sharing(pays)
        if pays:
            return
        self.actor_window = None
        if self.overlap is not None:
            self.overlap.close()
            self.overlap = None

    def _build_overlap(self) -> OverlapSchedule:
        o = self.rollplex
        executor = OverlapExecutor(self.accelerator.device, cpu_threads=o["rollplex_overlap_threads"],
                                   timeout_s=o["rollplex_overlap_timeout_s"])

        def record(metrics: dict[str, float], training: bool) -> None:
            for key, value in metrics.items():
                trl_compat.metrics(self, training)[key].append(value)

        def broadcast(decision: bool) -> bool:
            if self.accelerator.num_processes == 1:
                return decision
            from accelerate.utils import broadcast_object_list

            box = [decision]
            broadcast_object_list(box, from_process=0)
            return box[0]

        warn = notice if self.accelerator.is_main_process else (lambda message: None)
        return OverlapSchedule(o["rollplex_overlap"], executor, record=record, broadcast=broadcast, warn=warn)

    def _wrap_datasets(self) -> bool:
        """Wrap the video (and, with the shared prefix, image) datasets; returns whether any has video."""
        self.train_dataset = self.media.wrap(self.train_dataset, "train")
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {k: self.media.wrap(v, f"eval[{k}]") for k, v in self.eval_dataset.items()}
            evals = list(self.eval_dataset.values())
        else:
            self.eval_dataset = self.media.wrap(self.eval_dataset, "eval")
            evals = [self.eval_dataset]
        return self.media.has_video(self.train_dataset, *evals)

    def _record(self, key: str, value: float) -> None:
        trl_compat.metrics(self, self.model.training)[key].append(value)

    # ------------------------------------------------------------------------------------------------------------
    # Generation and scoring
    # ------------------------------------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        stream = self.media.stream_preparer
        if stream is not None and inputs and PREPARED_KEY not in inputs[0] and any(c in inputs[0]
                                                                                  for c in VIDEO_COLUMNS):
            inputs = stream.prepare_batch(inputs)  # a streamed video dataset
        rows = [x.get(PREPARED_KEY) for x in inputs]
        if all(r is None for r in rows):  # (the audit: the rollout engine's own log-probs, where it returns them)
            return audit_sampler(self, super()._generate_and_score_completions(inputs))
        if any(r is None for r in rows):
            raise RuntimeError("internal error: a generation batch mixes prepared and unprepared rows")
        with self.batch.generating(rows):
            output = super()._generate_and_score_completions(inputs)
            sampled = self.batch.take_sampler_logps()  # the transformers sampler's, on an audit step
        output[PREPARED_KEY] = rows  # a list: TRL shuffles and splits it together with the row tensors
        self.media.record_skips(self.train_dataset, self._record)
        return audit_sampler(self, output, transformers_logps=sampled)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.temporal is not None and self.model.training:  # the recipe's bonus columns, from the gathered rewards
            for key, value in self.temporal.rewards(self, inputs, prompts, completion_ids_list,
                                                    rewards_per_func).items():
                self._record(key, value)
        return rewards_per_func

    def _tokenize_prompts(self, prompts: list):
        rows = self.batch.generation_rows
        if rows is None:
            return super()._tokenize_prompts(prompts)
        if len(rows) != len(prompts):
            raise RuntimeError(f"internal error: {len(rows)} prepared prompts for {len(prompts)} prompts")
        return [list(r.prompt_ids) for r in rows], None, generation_fields(rows)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        trl_generate = super()._generate_single_turn

        def rollout(pool):
            return self.rollout.run(prompt_ids, images, multimodal_fields, num_generations, has_tool_images,
                                    trl_generate, pool=pool)

        def peer(pool):  # a pooled rollout's non-decoding rank: its decode window only
            self.rollout.peer(prompt_ids, images, num_generations, has_tool_images, pool)

        if self.temporal is not None:  # T-GRPO: what the shuffled rollout will reuse of the ordered one
            self.temporal.before_rollout(self)
        try:
            result = self.backend.generate(rollout, peer)
        except BaseException:
            self.batch.prefixes = StepPrefixes()  # a failed rollout leaves no state (nor its graph) behind
            raise
        if self.temporal is not None:  # T-GRPO: the shuffled copies' completions, for the rewards
            self.temporal.after_rollout(self, trl_generate)
        return result

    # ------------------------------------------------------------------------------------------------------------
    # Log-probs and loss
    # ------------------------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        memory = self.phase_memory
        if memory is None or not (self.model.training and torch.is_grad_enabled()):
            return self._loss_in_actor_window(model, inputs, return_outputs, num_items_in_batch)
        memory.decide_activation_offload(self, prompt_len=inputs["prompt_ids"].size(1),
                                         completion_len=inputs["completion_ids"].size(1),
                                         micro_batch=inputs["prompt_ids"].size(0))
        with memory.actor_activations():  # saved activations parked until the backward (rollplex_offload_activations)
            return self._loss_in_actor_window(model, inputs, return_outputs, num_items_in_batch)

    def _loss_in_actor_window(self, model, inputs, return_outputs, num_items_in_batch):
        rows = inputs.get(PREPARED_KEY)
        self._decide_sharing_from_mask(inputs["prompt_ids"], inputs["prompt_mask"])  # a custom rollout_func's batch
        actor = None
        # in a step's window the prefix serves every micro-batch (prefix/actor.py); outside one, the micro-batch's
        window = self.actor_window
        if (window is not None and window.is_open and self.model.training and torch.is_grad_enabled()
                and self._shareable(rows, inputs)):
            actor = window.prefix_for(
                self._trained_model(model), inputs["prompt_ids"], inputs["prompt_mask"], rows,
                window_index=self.state.global_step, window_prompts=self._window_prompts,
                precomputed=self.batch.prefixes.take_actor)
        with self.batch.scoring(rows, actor):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    def _window_prompts(self):
        """The prompts of the micro-batches of this accumulation window that the current generation buffer serves
        (a later generation may start inside a long window; its prompts get their own prefix when they arrive)."""
        spg = self.args.steps_per_generation
        step = trl_compat.micro_step(self)
        generate_every = spg * self.num_iterations
        count = min(self.actor_window.steps_left, generate_every - step % generate_every)
        buffered = trl_compat.buffered_inputs(self)
        batches = [buffered[(step + i) % spg] for i in range(count)]
        return [(b["prompt_ids"], b["prompt_mask"], b.get(PREPARED_KEY)) for b in batches]

    def training_step(self, model, inputs, num_items_in_batch):
        if self.actor_window is not None:
            self.actor_window.open(self.current_gradient_accumulation_steps)
        start = time.perf_counter()
        output = super().training_step(model, inputs, num_items_in_batch)
        if self.actor_window is not None:
            after = time.perf_counter()
            self.actor_window.step_done(self._trained_model(self.model))
            trl_compat.add_to_step_time(self, time.perf_counter() - after)  # part of the step TRL does not time
        if self.phase_memory is not None and (self.actor_window is None or not self.actor_window.is_open):
            self.phase_memory.activations_done(self._record)  # every backward that reads them has run
        self.timeline.add(Span("micro-step", "step", start, time.perf_counter()))  # includes the rollout
        if self.overlap is not None and trl_compat.micro_step(self) % self.current_gradient_accumulation_steps == 0:
            self.overlap.assert_idle()  # barrier 3: the optimizer step follows
        return output

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        if self.phase_memory is None:
            return self._logps_and_entropies(model, *args, **kwargs)
        with self.phase_memory.reference(model is self.ref_model):  # the reference model resident for its pass
            return self._logps_and_entropies(model, *args, **kwargs)

    def _logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                             compute_entropy=False, compute_aux_loss=False, **vision_kwargs):
        rows = self.batch.scored_rows
        if rows is not None:
            unexpected = [k for k in _TRL_VISION_KWARGS if vision_kwargs.get(k) is not None]
            if unexpected:
                raise RuntimeError(f"internal error: TRL passed vision inputs {unexpected} for prepared rows")
            check_rows_match_ids(rows, input_ids[:, : input_ids.size(1) - logits_to_keep])
        P = input_ids.size(1) - logits_to_keep
        self._decide_sharing_from_mask(input_ids[:, :P], attention_mask[:, :P])  # a custom rollout_func's batch
        if self.batch.actor is not None:  # the policy's loss pass: suffix against the accumulation window's prefix
            actor, row_to_prompt = self.batch.actor
            with self.accelerator.autocast():
                logps, entropies = self.backend.actor_suffix_logps(
                    self._trained_model(model), actor.leaf_state, row_to_prompt, input_ids[:, P:],
                    attention_mask[:, P:], temperature=self.temperature, compute_entropy=compute_entropy)
            self._log_prefix_use(actor.rows or input_ids.size(0), len(actor.key_to_prompt))
            audit_pass(self, model, logps, input_ids, attention_mask, logits_to_keep, vision_kwargs, ["actor prefix"])
            return logps, entropies, None
        # every other pass (reference, old, the actor outside a window): each prompt once per call where it can
        share = self.sharing.on and self._shareable(rows, vision_kwargs)
        precomputed = None
        if share and not torch.is_grad_enabled() and self.overlap is not None:  # built in the decode window
            precomputed = self.batch.prefixes.take_scoring(reference=model is self.ref_model)
        result = self.backend.logps_and_entropies(
            model, reference=model is self.ref_model, input_ids=input_ids, attention_mask=attention_mask,
            logits_to_keep=logits_to_keep, batch_size=batch_size, temperature=self.temperature,
            compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, rows=rows,
            vision_kwargs=vision_kwargs, autocast=self.accelerator.autocast, training=self.model.training,
            share_prefix=share, prompts_per_chunk=self.rollplex["rollplex_prefix_chunk_prompts"],
            precomputed=precomputed)
        if result is None:  # TRL's own pass
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **vision_kwargs)
        logps, entropies, num_prompts = result
        if num_prompts is not None:
            self._log_prefix_use(input_ids.size(0), num_prompts)
        audit_pass(self, model, logps, input_ids, attention_mask, logits_to_keep, vision_kwargs,
                   [m for m, on in (("shared prefix", share), ("decode-window prefix", precomputed)) if on])
        return logps, entropies, None

    def _trained_model(self, model):
        """The module the actor's passes run: the unwrapped policy, or the backend's own copy of it."""
        return self.backend.trained_model(model)

    def _log_prefix_use(self, rows: int, prompts: int) -> None:
        """`rollplex/prefix_rows_per_prompt`: completions served per prefix forward (G when a pass sees whole groups;
        for the actor, the whole window's rows count)."""
        self._record("rollplex/prefix_rows_per_prompt", rows / max(1, prompts))

    @staticmethod
    def _shareable(rows: list[PreparedPrompt] | None, vision_kwargs: dict) -> bool:
        """A batch can share prefixes when we know every row's prompt: prepared rows, or text-only rows (TRL's own
        image inputs come as one flat tensor without per-prompt identity)."""
        return rows is not None or all(vision_kwargs.get(k) is None for k in _TRL_VISION_KWARGS)

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints and the run (trainers/checkpoint.py)
    # ------------------------------------------------------------------------------------------------------------

    def train(self, *args: Any, **kwargs: Any):
        # resume_from_checkpoint=True: the newest complete checkpoint; a named one is checked (trainers/checkpoint.py)
        args, kwargs = resolve_resume_argument(self, args, kwargs)
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.overlap is not None:
                self.overlap.close()
            self._write_timeline()

    def end(self) -> None:
        """Finish the trackers and close the process group, as `Trainer.end` does, safely for a multi-process exit:
        every rank first waits for the others (only the main process writes in `save_model`/`push_to_hub`), and the
        references that keep the group alive after `destroy_process_group` (DDP's reducer through accelerate's
        prepared objects and `model_wrapped`; megatron-core's `parallel_state` through the backend) are dropped, so
        gloo's threads are joined while the interpreter is alive (one process aborted at exit with SIGABRT before;
        tests/test_ecosystem_cli.py checks none is left). The unwrapped `model` stays usable (saving, inference)."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed:
            self.accelerator.wait_for_everyone()
        # the rollout model takes the last weights; then what remains (saving, inference) is the transformers model
        self.backend.close()
        self.backend = HfBackend(self.accelerator.unwrap_model)
        if hasattr(super(), "end"):  # transformers >= 5.18
            super().end()
        else:
            for tracker in self.accelerator.trackers:
                tracker.finish()
            self.accelerator.state.destroy_process_group()
        if distributed and not self.accelerator.state.fork_launched:  # notebook_launcher keeps its group itself
            self.model_wrapped = self.model
            self.accelerator.free_memory()  # accelerate's references to the DDP wrapper (and optimizer/loaders)

    def _write_timeline(self) -> None:
        if not self.rollplex["rollplex_timeline"] or not self.timeline.spans or not self.is_world_process_zero():
            return
        out = Path(self.args.output_dir)
        trace = self.timeline.write_chrome_trace(out / "rollplex_timeline.json")
        png = self.timeline.write_gantt(out / "rollplex_timeline.png")
        notice(f"phase timeline written to {trace}" + (f" and {png}" if png else ""))

    def _get_train_sampler(self, dataset=None):
        # a resumed run must see the data of later epochs in the uninterrupted run's order (trainers/checkpoint.py)
        sampler = super()._get_train_sampler(dataset)
        if type(sampler) is trl_compat.RepeatSampler:
            sampler = ResumableRepeatSampler.from_sampler(sampler)
        loader_batch = trl_compat.train_batch_size(self) * self.args.steps_per_generation  # TRL's loader batch
        return self.backend.wrap_sampler(sampler, loader_batch, generation_batches=True)

    def _get_eval_sampler(self, eval_dataset):
        return self.backend.wrap_sampler(super()._get_eval_sampler(eval_dataset),
                                         self.args.per_device_eval_batch_size, generation_batches=False)

    # ------------------------------------------------------------------------------------------------------------
    # Optimizer (the Megatron backend trains its own parameters, not `self.model`'s)
    # ------------------------------------------------------------------------------------------------------------

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = self.backend.create_optimizer(self.args)  # None: transformers builds it
        if self.optimizer is None and self.phase_memory is not None:  # optimizer state streamed in chunks
            self.optimizer = self.phase_memory.create_optimizer(self, model)  # None: not streamable
        return super().create_optimizer(model)

    def _clip_grad_norm(self, model):
        norm = self.backend.clip_grad_norm(self.args.max_grad_norm)
        return norm if norm is not None else super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.backend.clip_grad_norm(None)  # None on the hf backend: transformers measures it
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def save_model(self, output_dir=None, _internal_call=False):
        self.backend.sync_rollout()  # the transformers model is what is saved: at the trained weights
        return super().save_model(output_dir, _internal_call)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # transformers' plain load skips weights saved under legacy names (Qwen2.5-VL): see trainers/checkpoint.py
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        if (not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
                and needs_converted_load(target, resume_from_checkpoint)):
            load_model_weights(target, resume_from_checkpoint)
        else:
            super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        self.backend.after_checkpoint_load(target)  # Megatron: the training shards from the loaded weights

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        self.backend.save_optimizer_state(self.optimizer, output_dir)  # Megatron: TP rank r > 0's shard

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.backend.load_optimizer_state(self.optimizer, checkpoint)

    def _load_best_model(self) -> None:
        # load_best_model_at_end reads checkpoints the same plain way: same correction
        best = self.state.best_model_checkpoint
        target = self.accelerator.unwrap_model(self.model)
        if best and not (self.is_deepspeed_enabled or self.is_fsdp_enabled) and needs_converted_load(target, best):
            load_model_weights(target, best)
            return
        super()._load_best_model()

    def _save_checkpoint(self, model, trial) -> None:
        self.backend.sync_rollout()
        # written into tmp-checkpoint-N, renamed to checkpoint-N once complete (crash safety: trainers/checkpoint.py)
        with self.checkpoint_staging.staged(self, trial):
            super()._save_checkpoint(model, trial)

    def _get_output_dir(self, trial) -> str:
        # while a checkpoint is written, the Trainer's (and TRL's) writes go to its staging folder
        return self.checkpoint_staging.output_dir(super()._get_output_dir(trial))

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # a staged checkpoint is uploaded once it has its final name
        self.checkpoint_staging.push(checkpoint_folder, super()._push_from_checkpoint)

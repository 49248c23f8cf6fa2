"""`RollplexGRPOTrainer`: TRL's GRPOTrainer, plus video, with the narrowest overrides that work.

What this class changes, and where:
- `__init__`: wraps datasets that have a `video`/`videos` column in a `PreparedPromptDataset` (media decoded and
  processed once per prompt); suppresses the video placeholder token in sampling as TRL does for images.
- `_generate_and_score_completions`: for batches of prepared prompts, makes the rows' vision inputs visible to the
  old/ref log-prob passes TRL runs inside, and returns them per row (`rollplex_prompt`) so they follow TRL's
  shuffling and micro-batch splitting. Everything else (rewards, advantages, metrics) is TRL's own code.
- `_tokenize_prompts`: token ids and vision tensors come from the prepared prompts instead of a second processor
  pass (TRL's collects images only).
- `_get_per_token_logps_and_entropies`: for prepared rows, builds each chunk's vision inputs (images, videos,
  `second_per_grid_ts`, `mm_token_type_ids`) and calls the model exactly like TRL (fused LM head, labels).
- `compute_loss` / `training_step`: make the micro-batch's rows visible to the actor pass and run the actor's shared
  prefix once per gradient-accumulation window (trainers/actor.py); the loss itself is TRL's.
- `_get_train_sampler`, `_load_from_checkpoint`, `_load_best_model`: exact resume (trainers/checkpoint.py).
The overlap (trainers/overlap.py) and the vLLM engine (trainers/vllm.py) are mixins of their own. Batches without
prepared prompts (text, or images in TRL's `image`/`images` columns) run TRL's code unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import time
from collections.abc import Callable, Iterator
from typing import Any

import datasets
import torch
from trl import GRPOTrainer
from trl.trainer.grpo_trainer import is_async_callable  # TRL's own test for async reward functions
from trl.trainer.utils import RepeatSampler

from rollplex_trl.config import rollplex_options
from rollplex_trl.data.errors import RollplexDataError
from rollplex_trl.data.framed import FramedMediaPreparer, FramedPromptDataset
from rollplex_trl.data.prepared import (
    IMAGE_COLUMNS,
    PREPARED_KEY,
    VIDEO_COLUMNS,
    MediaOptions,
    MediaPreparer,
    PreparedPromptDataset,
    StreamPreparer,
    has_column,
    has_video_column,
)
from rollplex_trl.data.prompt import (
    PreparedPrompt,
    check_rows_match_ids,
    generation_fields,
    token_type_ids,
    vision_inputs,
)
from rollplex_trl.data.video import VideoSamplingConfig
from rollplex_trl.executor import Span
from rollplex_trl.prefix import suffix_logps
from rollplex_trl.prefix.batch import ActorPrefix, shared_prefix_logps
from rollplex_trl.prefix.generation import shared_prefill
from rollplex_trl.trainers.actor import ActorPrefixMixin
from rollplex_trl.trainers.checkpoint import (
    ResumableRepeatSampler,
    defer_push,
    load_model_weights,
    needs_converted_load,
    resolve_resume_argument,
    staged_checkpoint,
    staging_output_dir,
)
from rollplex_trl.trainers.overlap import OverlapMixin
from rollplex_trl.trainers.vllm import VLLMEngineMixin, trainer_init_arguments  # vLLM engine (rollout/)

logger = logging.getLogger(__name__)

# Decoders whose prefix/suffix split is implemented and tested (full attention, RoPE or M-RoPE).
_PREFIX_MODEL_TYPES = ("qwen2", "qwen2_5_vl", "llama")

# Keyword arguments of TRL's `_get_per_token_logps_and_entropies` that carry vision inputs.
_TRL_VISION_KWARGS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                      "token_type_ids", "mm_token_type_ids", "image_position_ids")


class RollplexGRPOTrainer(VLLMEngineMixin, OverlapMixin, ActorPrefixMixin, GRPOTrainer):
    """Drop-in replacement for `trl.GRPOTrainer` that also trains on video (Qwen2.5-VL).

    Use it like `GRPOTrainer`; configure it with `RollplexGRPOConfig` (a `GRPOConfig` subclass; a plain
    `GRPOConfig` also works and gets the safe defaults of every `rollplex_*` field).
    """

    _tag_names = ["trl", "grpo", "rollplex"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse_before_setup(*args, **kwargs)
        super().__init__(*args, **kwargs)
        self.rollplex = rollplex_options(self.args)
        _refuse_several_returned_sequences(getattr(self, "generation_config", None))
        # Rows of the batch whose log-probs are being computed (None outside our passes): see `_rows_in_flight`.
        self._rows_in_flight: list[PreparedPrompt] | None = None
        # Prepared prompts of the generation batch being tokenized, consumed by `_tokenize_prompts`.
        self._rows_to_tokenize: list[PreparedPrompt] | None = None
        # Shared prefix: which passes may use it (decided once, with reasons), and the policy's prefix of the
        # current gradient-accumulation window (see `_actor_prefix_for`).
        self._share_scoring, self._share_actor = self._decide_prefix_sharing()
        self._actor_prefix: list[ActorPrefix] = []
        self._window_steps_left = 0
        self._actor_rows_in_flight: tuple[ActorPrefix, torch.Tensor] | None = None
        self._init_overlap()  # prefix jobs in the rollout's decode window (trainers/overlap.py)
        if self._wrap_datasets():
            self._suppress_video_token()
        self.memory_ledger = self._setup_memory_ledger() if self.rollplex["rollplex_memory_ledger"] else None
        self.reward_funcs = [_reject_nan_rewards(f, name) for f, name in zip(self.reward_funcs,
                                                                              self.reward_func_names, strict=True)]

    # ------------------------------------------------------------------------------------------------------------
    # Setup
    # ------------------------------------------------------------------------------------------------------------

    def _media_options(self) -> MediaOptions:
        o = self.rollplex
        return MediaOptions(
            sampling=VideoSamplingConfig(
                fps=o["rollplex_video_fps"], min_frames=o["rollplex_video_min_frames"],
                max_frames=o["rollplex_video_max_frames"], min_pixels=o["rollplex_video_min_pixels"],
                max_pixels=o["rollplex_video_max_pixels"],
            ),
            max_prompt_length=o["rollplex_max_prompt_length"],
            skip_invalid=o["rollplex_skip_invalid_samples"],
            max_skipped_fraction=o["rollplex_max_skipped_fraction"],
            cache_size=o["rollplex_media_cache_size"],
            chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
        )

    def _wrap(self, dataset: Any, name: str) -> Any:
        if dataset is None or isinstance(dataset, PreparedPromptDataset):
            return dataset
        if not has_video_column(dataset):
            # Image datasets take TRL's own path, unless the shared prefix is on: it needs each row's prompt
            # identity and per-prompt pixels, which the prepared path provides.
            shareable_images = (self._share_scoring and self._is_vlm and not self.tools
                                and self.environment_factories is None and self.rollout_func is None
                                and hasattr(dataset, "__getitem__")
                                and not isinstance(dataset, torch.utils.data.IterableDataset)
                                and has_column(dataset, IMAGE_COLUMNS))
            if not shareable_images:
                return dataset
            return self._prepared_dataset(dataset)
        if not self._is_vlm:
            raise RollplexDataError(
                f"the {name} dataset has a video column but the processing class is a tokenizer, not a processor. "
                "Pass the model's processor (e.g. AutoProcessor.from_pretrained(...)) as processing_class."
            )
        streamed = isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__")
        if streamed and not isinstance(dataset, datasets.IterableDataset):
            raise RollplexDataError(
                f"the {name} dataset is iterable but not a datasets.IterableDataset; TRL groups the G completions "
                "of a prompt only in map-style datasets and datasets.IterableDataset streams. Wrap it with "
                "datasets.IterableDataset.from_generator(...)."
            )
        if self.tools or self.environment_factories is not None or self.rollout_func is not None:
            raise NotImplementedError("video prompts with tools, environments or a rollout_func are not supported.")
        if streamed:  # TRL reorders the stream itself: its rows are prepared per generation batch
            if self._stream_preparer is None:
                preparer_cls = FramedMediaPreparer if self.use_vllm else MediaPreparer
                options = self._media_options()
                self._stream_preparer = StreamPreparer(preparer_cls(self.processing_class, options), options)
            return dataset
        return self._prepared_dataset(dataset)

    def _prepared_dataset(self, dataset: Any) -> PreparedPromptDataset:
        # vLLM processes media itself from frames and images (it cannot take pixel patches): its rows keep the
        # media our loader decoded, so nothing is decoded twice (rollout/multimodal.py)
        cls = FramedPromptDataset if self.use_vllm else PreparedPromptDataset
        return cls(dataset, self.processing_class, self._media_options())

    def _wrap_datasets(self) -> bool:
        """Wrap the video (and, with the shared prefix, image) datasets; returns whether any has video."""
        self._stream_preparer: StreamPreparer | None = None
        self.train_dataset = self._wrap(self.train_dataset, "train")
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {k: self._wrap(v, f"eval[{k}]") for k, v in self.eval_dataset.items()}
            evals = list(self.eval_dataset.values())
        else:
            self.eval_dataset = self._wrap(self.eval_dataset, "eval")
            evals = [self.eval_dataset]
        return self._stream_preparer is not None or any(
            isinstance(d, PreparedPromptDataset) and has_video_column(d.base) for d in [self.train_dataset, *evals])

    def _setup_memory_ledger(self):
        """Phases from TRL's callbacks plus a `rollout` phase around generation; the actor prefix (boundary state,
        from the window's first micro-batch to its backward) is registered so its bytes show in `rollplex/mem_*`."""
        from rollplex_trl.callbacks import MemoryPhaseCallback
        from rollplex_trl.memory import MemoryLedger, MemoryRegistry, ResidencyManager, wrap_in_phase

        registry = MemoryRegistry()
        ledger = MemoryLedger(registry, device=self.accelerator.device)
        manager = ResidencyManager(registry, ledger)
        registry.register_tensors(
            "actor_prefix", lambda: [t for a in self._actor_prefix for t in (*a.leaf_state.kv_tensors(), *a.outputs)],
            "boundary", "train", "train")
        self.add_callback(MemoryPhaseCallback(manager, trainer=self))
        wrap_in_phase(self, "_generate", manager, "rollout")
        return ledger

    def _decide_prefix_sharing(self) -> tuple[bool, bool]:
        """Whether the no-grad scoring passes (reference, old) and the actor pass may use the shared prefix.

        Exactness needs: a decoder we know (full attention, Qwen2/Qwen2.5-VL/Llama family), no MoE aux loss, and
        completions without tool outputs, and no DeepSpeed/FSDP (their parameter gathers run in the wrapper's
        forward, which the prefix/suffix passes bypass). Under multi-process DDP the actor pass bypasses DDP's
        forward too, so DDP does not reduce its gradients: the trainer averages them itself once per window
        (`_average_gradients_across_processes`), which is what DDP computes.
        """
        mode = self.rollplex["rollplex_share_prefix"]
        if mode == "off":
            return False, False
        config = self.accelerator.unwrap_model(self.model).config
        blockers = []
        if getattr(config, "model_type", None) not in _PREFIX_MODEL_TYPES:
            blockers.append(f"model type {getattr(config, 'model_type', None)!r} is not one of {_PREFIX_MODEL_TYPES}")
        if self.aux_loss_enabled:
            blockers.append("the MoE router aux loss is not returned by the suffix pass")
        if self.tools or self.environment_factories is not None:
            blockers.append("tool/environment turns put non-model tokens (and images) inside completions")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            blockers.append("DeepSpeed/FSDP shard parameters; the prefix pass would run outside their gather hooks")
        # multi-process without DeepSpeed/FSDP is DDP (or its CPU/XPU/NPU variants): gradients averaged by us
        self._average_actor_gradients = self.accelerator.num_processes > 1
        if blockers:
            message = f"rollplex_share_prefix: off: {'; '.join(blockers)}"
            if mode == "on":
                raise ValueError(message + " (set rollplex_share_prefix='auto' or 'off')")
            self._warn_once(message)
        # every known blocker applies to the scoring and actor passes alike
        return not blockers, not blockers

    def _warn_once(self, message: str) -> None:
        """A configuration notice: logged once per job (by the main process), not once per rank or per call."""
        seen = self.__dict__.setdefault("_rollplex_warned", set())
        if message not in seen and self.accelerator.is_main_process:
            logger.warning(message)
        seen.add(message)

    def _suppress_video_token(self) -> None:
        # TRL suppresses the image placeholder in sampling ("a sampled image token would mismatch the image
        # features"); a sampled video placeholder would do the same to the video features. Only for video
        # datasets: changing the sampling distribution otherwise would make image/text runs differ from TRL's.
        video_token_id = getattr(self.model.config, "video_token_id", None)
        gen_config = getattr(self, "generation_config", None)
        if not self._is_vlm or video_token_id is None or gen_config is None:
            return
        suppressed = list(gen_config.suppress_tokens or [])
        if video_token_id not in suppressed:
            gen_config.suppress_tokens = suppressed + [video_token_id]
            self.generation_kwargs["suppress_tokens"] = gen_config.suppress_tokens

    # ------------------------------------------------------------------------------------------------------------
    # Generation and scoring
    # ------------------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _rows_in_flight_as(self, rows: list[PreparedPrompt] | None) -> Iterator[None]:
        """Make `rows` (one PreparedPrompt per batch row) the vision inputs of the log-prob passes inside."""
        previous = self._rows_in_flight
        self._rows_in_flight = rows
        try:
            yield
        finally:
            self._rows_in_flight = previous

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if (self._stream_preparer is not None and inputs and PREPARED_KEY not in inputs[0]
                and any(c in inputs[0] for c in VIDEO_COLUMNS)):
            inputs = self._stream_preparer.prepare_batch(inputs)  # a streamed video dataset
        rows = [x.get(PREPARED_KEY) for x in inputs]
        if all(r is None for r in rows):
            return super()._generate_and_score_completions(inputs)
        if any(r is None for r in rows):
            raise RuntimeError("internal error: a generation batch mixes prepared and unprepared rows")
        self._rows_to_tokenize = rows
        try:
            with self._rows_in_flight_as(rows):
                output = super()._generate_and_score_completions(inputs)
        finally:
            self._rows_to_tokenize = None
        output[PREPARED_KEY] = rows  # a list: TRL shuffles and splits it together with the row tensors
        sources = [d for d in (self.train_dataset, self._stream_preparer) if hasattr(d, "num_skipped")]
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["rollplex/skipped_samples"].append(float(sum(d.num_skipped for d in sources)))
        metrics["rollplex/skipped_fraction"].append(max([float(d.skipped_fraction) for d in sources], default=0.0))
        return output

    def _tokenize_prompts(self, prompts: list):
        rows = self._rows_to_tokenize
        if rows is None:
            return super()._tokenize_prompts(prompts)
        if len(rows) != len(prompts):
            raise RuntimeError(f"internal error: {len(rows)} prepared prompts for {len(prompts)} prompts")
        return [list(r.prompt_ids) for r in rows], None, generation_fields(rows)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # The transformers rollout: prefill each prompt once for its G samples (see prefix/generation.py). vLLM and
        # continuous batching have their own prefix caching; TRL's own image path has no per-prompt identity.
        rows = self._rows_to_tokenize
        if (not self._share_scoring or self.use_vllm or self.use_transformers_continuous_batching
                or num_generations < 2 or has_tool_images or (rows is None and images is not None)
                or self._generation_expands_rows()):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        mode = "train" if self.model.training else "eval"

        def log(rows_count: int, prompts: int) -> None:
            self._metrics[mode]["rollplex/prefill_rows_per_prompt"].append(rows_count / max(1, prompts))

        with shared_prefill(self.accelerator.unwrap_model(self.model), rows, on_prefill=log,
                            decode_window=self._decode_window_factory(rows)):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)

    def _generation_expands_rows(self) -> bool:
        """Beam search makes `generate` expand its batch after the prefill, which a prefilled shared cache (one row
        per sample) cannot follow: TRL's own generate path runs instead."""
        config = getattr(self, "generation_config", None)
        beams = getattr(config, "num_beams", 1) or 1
        if beams > 1:
            self._warn_once(f"rollplex: shared prefill off for generation (num_beams={beams}): beam search expands "
                            "the batch inside generate; prefix work is computed when scored")
            return True
        return False

    # ------------------------------------------------------------------------------------------------------------
    # Log-probs and loss
    # ------------------------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rows = inputs.get(PREPARED_KEY)
        actor = None
        # Inside a training step's window the prefix is shared across micro-batches (see `_actor_prefix_for`);
        # a direct call outside one still shares within the micro-batch (`_get_per_token_logps_and_entropies`).
        if (self._share_actor and self._window_steps_left > 0 and self.model.training and torch.is_grad_enabled()
                and self._shareable(rows, inputs)):
            actor = self._actor_prefix_for(model, inputs, rows)
        with self._rows_in_flight_as(rows):
            self._actor_rows_in_flight = actor
            try:
                return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
            finally:
                self._actor_rows_in_flight = None

    def training_step(self, model, inputs, num_items_in_batch):
        if self._share_actor and self._window_steps_left == 0:
            self._window_steps_left = self.current_gradient_accumulation_steps
        start = time.perf_counter()
        output = super().training_step(model, inputs, num_items_in_batch)
        if self._share_actor:
            self._window_steps_left -= 1
            if self._window_steps_left == 0:
                self._finish_actor_prefix()
                if self._average_actor_gradients:
                    self._average_gradients_across_processes()
        self.timeline.add(Span("micro-step", "step", start, time.perf_counter()))  # includes the rollout
        if self.overlap_executor is not None and self._step % self.current_gradient_accumulation_steps == 0:
            self.overlap_executor.assert_idle()  # barrier 3: the optimizer step follows
        return output

    def _get_train_sampler(self, dataset=None):
        # a resumed run must see the data of later epochs in the uninterrupted run's order (trainers/checkpoint.py)
        sampler = super()._get_train_sampler(dataset)
        return ResumableRepeatSampler.from_sampler(sampler) if type(sampler) is RepeatSampler else sampler

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # transformers' plain load skips weights saved under legacy names (Qwen2.5-VL): see trainers/checkpoint.py
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        if (not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
                and needs_converted_load(target, resume_from_checkpoint)):
            load_model_weights(target, resume_from_checkpoint)
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)

    def _load_best_model(self) -> None:
        # load_best_model_at_end reads checkpoints the same plain way: same correction
        best = self.state.best_model_checkpoint
        target = self.accelerator.unwrap_model(self.model)
        if best and not (self.is_deepspeed_enabled or self.is_fsdp_enabled) and needs_converted_load(target, best):
            load_model_weights(target, best)
            return
        super()._load_best_model()

    def _save_checkpoint(self, model, trial) -> None:
        # written into tmp-checkpoint-N, renamed to checkpoint-N once complete (crash safety: trainers/checkpoint.py)
        with staged_checkpoint(self, trial):
            super()._save_checkpoint(model, trial)

    def _get_output_dir(self, trial) -> str:
        # while a checkpoint is written, the Trainer's (and TRL's) writes go to its staging folder
        return staging_output_dir(self, super()._get_output_dir(trial))

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # a staged checkpoint is uploaded once it has its final name
        defer_push(self, checkpoint_folder, super()._push_from_checkpoint)

    def train(self, *args: Any, **kwargs: Any):
        # resume_from_checkpoint=True: the newest complete checkpoint; a named one is checked (trainers/checkpoint.py)
        args, kwargs = resolve_resume_argument(self, args, kwargs)
        try:
            return super().train(*args, **kwargs)
        finally:
            self._precomputed.clear()
            if self.overlap_executor is not None:
                self.overlap_executor.close()
            self._write_timeline()

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **vision_kwargs):
        rows = self._rows_in_flight
        if rows is not None:
            unexpected = [k for k in _TRL_VISION_KWARGS if vision_kwargs.get(k) is not None]
            if unexpected:
                raise RuntimeError(f"internal error: TRL passed vision inputs {unexpected} for prepared rows")
            check_rows_match_ids(rows, input_ids[:, : input_ids.size(1) - logits_to_keep])
        if self._actor_rows_in_flight is not None:  # the policy's loss pass: suffix against this window's prefix
            actor, row_to_prompt = self._actor_rows_in_flight
            P = input_ids.size(1) - logits_to_keep
            with self.accelerator.autocast():
                logps, entropies = suffix_logps(
                    self.accelerator.unwrap_model(model), actor.leaf_state, row_to_prompt, input_ids[:, P:],
                    attention_mask[:, P:], temperature=self.temperature, compute_entropy=compute_entropy)
            self._log_prefix_use(input_ids.size(0), len(actor.key_to_prompt))
            return logps, entropies, None
        share = self._share_actor if torch.is_grad_enabled() else self._share_scoring
        if share and self._shareable(rows, vision_kwargs):  # each prompt once per call, in one graph
            with self.accelerator.autocast():
                logps, entropies, num_prompts = shared_prefix_logps(
                    self.accelerator.unwrap_model(model), input_ids, attention_mask, logits_to_keep, rows,
                    temperature=self.temperature, compute_entropy=compute_entropy,
                    prompts_per_chunk=self.rollplex["rollplex_prefix_chunk_prompts"],
                    precomputed=None if torch.is_grad_enabled() else self._take_precomputed(
                        "ref" if model is self.ref_model else "old"))
            self._log_prefix_use(input_ids.size(0), num_prompts)
            return logps, entropies, None
        if rows is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **vision_kwargs,
            )
        return self._prepared_rows_logps(model, rows, input_ids, attention_mask, logits_to_keep, batch_size,
                                         compute_entropy, compute_aux_loss)

    def _log_prefix_use(self, rows: int, prompts: int) -> None:
        """`rollplex/prefix_rows_per_prompt`: completions served per prefix forward (G when a pass sees whole groups;
        for the actor, the whole window's rows count, see `_actor_prefix_for`)."""
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["rollplex/prefix_rows_per_prompt"].append(rows / max(1, prompts))

    @staticmethod
    def _shareable(rows: list[PreparedPrompt] | None, vision_kwargs: dict) -> bool:
        """A batch can share prefixes when we know every row's prompt: prepared rows, or text-only rows (TRL's own
        image inputs come as one flat tensor without per-prompt identity)."""
        return rows is not None or all(vision_kwargs.get(k) is None for k in _TRL_VISION_KWARGS)

    def _prepared_rows_logps(self, model, rows, input_ids, attention_mask, logits_to_keep, batch_size,
                             compute_entropy, compute_aux_loss):
        """TRL's chunked fused-head log-prob pass, with each chunk's vision inputs built from its rows."""
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
            with self.accelerator.autocast():
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


def _refuse_before_setup(*args: Any, **kwargs: Any) -> None:
    """Refuse combinations we cannot run before GRPOTrainer's setup connects to a vLLM server or loads weights."""
    bound = trainer_init_arguments(*args, **kwargs)
    config = bound.get("args")
    if config is None or not (config.use_vllm and config.vllm_mode == "server"):
        return
    evals = bound.get("eval_dataset")
    datasets = {"train": bound.get("train_dataset"),
                **({f"eval[{k}]": v for k, v in evals.items()} if isinstance(evals, dict) else {"eval": evals})}
    for name, dataset in datasets.items():
        if dataset is not None and has_video_column(dataset):
            raise NotImplementedError(
                f"the {name} dataset has videos, but vllm_mode='server' cannot carry them: TRL's server protocol "
                "sends images only. Use vllm_mode='colocate' (or use_vllm=False) for video prompts."
            )


def _refuse_several_returned_sequences(generation_config: Any) -> None:
    # GRPO samples num_generations completions per prompt itself; generate returning several per row would misalign
    # every row after it (TRL's own path then fails deep inside with a tensor-size error).
    returned = getattr(generation_config, "num_return_sequences", 1) or 1
    if returned > 1:
        raise ValueError(f"generation_kwargs sets num_return_sequences={returned}: GRPO draws num_generations "
                         "completions per prompt itself. Remove num_return_sequences and set num_generations instead.")


def _reject_nan_rewards(func: Callable, name: str) -> Callable:
    """Make a synchronous reward function fail loudly when it returns NaN or an infinity, of any numeric type.

    TRL reads `None` as "this reward does not apply to this sample" and turns it into NaN, which later sums as 0. A
    NaN coming back from the function itself is a bug in the reward, and would be treated the same way: silently;
    an infinity would swamp the group's advantages. Python, NumPy and 0-d/1-element torch numbers are all checked.
    Models (nn.Module) and async functions are returned unchanged.
    """
    if isinstance(func, torch.nn.Module) or not callable(func) or is_async_callable(func):
        return func

    @functools.wraps(func)
    def checked(*args: Any, **kwargs: Any):
        rewards = func(*args, **kwargs)
        for i, r in enumerate(rewards):
            value = _reward_value(r)
            if value is not None and not math.isfinite(value):
                ids = kwargs.get("problem_id")
                sample = f"problem_id={ids[i]}" if isinstance(ids, list) and i < len(ids) else f"row {i}"
                raise RollplexDataError(
                    f"reward function '{name}' returned {'NaN' if math.isnan(value) else value} ({type(r).__name__}) "
                    f"for {sample} of the batch. "
                    "Return None for samples the reward does not apply to, or fix the reward."
                )
        return rewards

    return checked


def _reward_value(r: Any) -> float | None:
    """A reward as a float, or None where it is not a single number (None, or a type TRL itself will refuse)."""
    if r is None or isinstance(r, bool):
        return None
    if isinstance(r, torch.Tensor):
        return float(r) if r.numel() == 1 else None
    if isinstance(r, numbers.Real) or (hasattr(r, "dtype") and getattr(r, "shape", None) == ()):  # NumPy scalars
        try:
            return float(r)
        except (TypeError, ValueError):
            return None
    return None

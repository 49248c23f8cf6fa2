"""`MegatronBackend`: the `TrainingBackend` (backends/base.py) of `rollplex_backend="megatron"`: what changes around
TRL's step, and why.

The LLM trains as Megatron-Core's GPTModel, tensor-parallel over t ranks (`backends/megatron/`); the vision tower
is replicated (a trainable copy on every rank); the transformers model TRL built stays the **rollout engine** (its
`generate`), with its weights bound to the training parameters (`backends/megatron/mapped_weights.py`: mapped onto
every TP rank's shards through shared memory; `rollout_weights.py`: views of local shards + a rebuild). Processes
come from `accelerate launch`/`torchrun`; ranks are laid out as Megatron does: TP groups are consecutive ranks, the
data-parallel rank is `rank // t`.

Around TRL's step:
- **data**: the t ranks of a TP group must train on the same rows. Every rank still runs TRL's code as one of the
  world's processes (so TRL's gathers, reward normalization, per-process slicing and loss normalizer all stay TRL's);
  the sampler hands each TP peer the rows of its DP rank (`TensorParallelReplicaSampler`). The duplicated rows make
  TRL's gathered tensors hold each DP rank's rows t times, which leaves group statistics, `process_slice` and the
  DAPO normalizer (`num_items_in_batch / num_processes`) exactly what a DP-only run computes.
- **rollout**: each process generates from the transformers model after the on-policy barrier (`sync_rollout`);
  TP peers are seeded alike (`seed + dp_rank`) and their completions are then made identical by a broadcast from
  the group's first rank, so a nondeterministic kernel cannot split a TP group's view of the batch.
- **log-probs** (reference, old, actor): Megatron forward, vocab-parallel log-softmax (no full-vocabulary gather).
- **gradients**: accelerate does not wrap the model in DDP (the transformers model has no trainable parameter), so
  the gradients are averaged over the DP group here, once per optimizer step, before the TP-aware clipping.
- **optimizer**: `torch.optim.AdamW` over this rank's training parameters (shards + the vision tower copy).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Sampler

from rollplex_trl.data.prompt import PreparedPrompt, token_type_ids, vision_inputs
from rollplex_trl.notices import notice
from rollplex_trl.prefix.generation import BackendPrefill
from rollplex_trl.rollout.sources import bind_weights

logger = logging.getLogger(__name__)

# TrainingArguments.optim values this backend builds (torch's AdamW; fused for adamw_torch_fused, else torch's default)
SUPPORTED_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")


def refuse_megatron_setup(config: Any, *, peft_config: Any, world_size: int, train_dataset: Any) -> None:
    """Refuse what the Megatron backend cannot run, naming the fields, before any weights are loaded."""
    if getattr(config, "rollplex_backend", "hf") != "megatron":
        return
    t = config.rollplex_tensor_parallel_size
    problems = []
    if world_size % t:
        problems.append(f"the world size {world_size} (processes from accelerate launch / torchrun) is not a "
                        f"multiple of rollplex_tensor_parallel_size={t}")
    if getattr(config, "deepspeed", None) or getattr(config, "fsdp", None):
        problems.append("DeepSpeed/FSDP shard the model themselves; with rollplex_backend='megatron' Megatron-Core "
                        "does the sharding (remove deepspeed/fsdp from the config or the accelerate launch config)")
    if peft_config is not None:
        problems.append("PEFT adapters are not supported on the Megatron backend yet (use rollplex_backend='hf')")
    if config.use_vllm and config.vllm_mode != "colocate":
        problems.append(f"use_vllm=True with vllm_mode={config.vllm_mode!r}: the Megatron backend feeds the vLLM "
                        "engine from the transformers model it keeps in sync with the shards, in each process; "
                        "use vllm_mode='colocate' (or use_vllm=False)")
    if config.optim not in SUPPORTED_OPTIMIZERS:
        problems.append(f"optim={config.optim!r}: the Megatron backend builds torch's AdamW "
                        f"(optim one of {SUPPORTED_OPTIMIZERS})")
    if t > 1 and isinstance(train_dataset, torch.utils.data.IterableDataset):
        problems.append("a streamed (iterable) train_dataset cannot give the t ranks of a TP group the same rows "
                        "yet; use a map-style dataset or rollplex_tensor_parallel_size=1")
    if problems:
        raise ValueError("rollplex_backend='megatron': " + "; ".join(problems))


class TensorParallelReplicaSampler(Sampler[int]):
    """Every block of `block` indices of `inner`, `copies` times in a row.

    accelerate's data loader deals the sampler's batches round-robin over the world's processes (batch i to process
    i % world). With `block` = the loader's batch size and `copies` = t, process p gets block p // t: the t ranks of a
    TP group (consecutive ranks) get the same rows, the rows of their DP rank. `inner` is TRL's RepeatSampler sized
    for the DP world, so the DP ranks together see exactly what a t = 1 run with the same DP size sees.
    """

    def __init__(self, inner: Sampler[int], block: int, copies: int) -> None:
        self.inner, self.block, self.copies = inner, block, copies

    def __iter__(self) -> Iterator[int]:
        pending: list[int] = []
        for index in self.inner:
            pending.append(index)
            if len(pending) == self.block:
                for _ in range(self.copies):
                    yield from pending
                pending = []
        for _ in range(self.copies):  # a last partial block (the loader drops or pads it, as without TP)
            yield from pending

    def __len__(self) -> int:
        return len(self.inner) * self.copies

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)


def _decay_groups(named: Sequence[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    # The Trainer's rule: no weight decay for biases and norm weights (names decide here: Megatron's norms are
    # `*layernorm*`/`*norm*` modules, transformers' `*norm*`).
    def no_decay(name: str) -> bool:
        return name.endswith("bias") or "norm" in name.lower()

    return [{"params": [p for n, p in named if not no_decay(n)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}]


class MegatronBackend:
    """The trainer's Megatron component: the training model(s), the rollout binding, gradient reduction."""

    name = "megatron"
    suffix_attention_mode = "concat"  # its own suffix pass (backends/megatron/prefix.py)

    def __init__(self, *, rollout_model: nn.Module, ref_model: nn.Module | None, tensor_parallel_size: int,
                 seed: int, record: Callable[[str, float], None], is_main_process: bool,
                 weight_mapping: str = "auto", shm_all_reduce: str = "auto", pooled_rollout: str = "auto",
                 use_vllm: bool = False, overlap: str = "auto", row_parallel_views: str = "auto",
                 activation_recompute: bool = False, split_vision: str = "auto") -> None:
        from rollplex_trl.backends.megatron import MegatronPolicy, init_model_parallel

        self.groups = init_model_parallel(tensor_parallel_size)
        self.record = record
        self.policy = MegatronPolicy(rollout_model, self.groups)
        if self.policy.visual is not None:
            # The trainable vision tower is the policy's own copy; the rollout model's tower becomes views of it
            # (LiveRolloutWeights aliases every replicated tensor), so the optimizer's update is the rollout's.
            self.policy.visual = copy.deepcopy(self.policy.visual)
        self.ref = None
        if ref_model is not None:
            self.ref = MegatronPolicy(ref_model, self.groups).requires_grad_(False).eval()
        for p in rollout_model.parameters():
            p.requires_grad_(False)  # also keeps accelerate from wrapping it in DDP: gradients are ours to reduce
        self.policy.requires_grad_(True)
        recompute_note = "off (gradient_checkpointing=False)"
        if activation_recompute:  # TRL's gradient_checkpointing: every LLM layer recomputed in the backward
            from rollplex_trl.backends.megatron.recompute import enable_layer_recompute

            recompute_note = f"every LLM layer ({enable_layer_recompute(self.policy.gpt)}, gradient_checkpointing)"
        self._rollout_model = rollout_model
        # read by the vLLM engine's weight sync: it must copy from this model, not move its tensors into vLLM's
        bind_weights(rollout_model, "the Megatron training shards")
        self.rollout, not_mapped = self._bind_rollout(weight_mapping, row_parallel_views, use_vllm,
                                                      log=is_main_process)
        self.all_reduce, all_reduce_note = self._route_all_reduce(shm_all_reduce, rollout_model.device)
        self.rollout_pool, pool_note = self._pool_rollout(pooled_rollout, rollout_model.device, use_vllm, overlap)
        self.vision_split, vision_note = self._split_vision(split_vision)
        if is_main_process:
            unmapped = f" (not mapped across processes: {not_mapped})" if not_mapped else ""
            notice(f"Megatron backend, t={self.groups.tp_size}, data-parallel {self.groups.dp_size}; "
                   f"{self.rollout.table()}{unmapped}; TP all-reduce: {all_reduce_note}; rollout: {pool_note}; "
                   f"activation recompute: {recompute_note}; vision tower: {vision_note}")
            if not_mapped is None:  # the plan it executes, by parameter kind (logged once)
                logger.info("rollplex: the rollout weight-mapping plan\n%s", self.rollout.plan.format())
        self._reduced = False  # whether this optimizer step's gradients were averaged over DP already
        # TP peers draw the same samples (the hf backend in one process draws with seed + 0, as DP rank 0 does here)
        from transformers import set_seed

        set_seed(seed + self.groups.dp_rank)

    @classmethod
    def from_trainer(cls, trainer: Any) -> MegatronBackend:
        """Built from a `RollplexGRPOTrainer` after TRL's setup: its models and `rollplex_*` options."""
        from rollplex_trl import trl_compat

        options, accelerator = trainer.rollplex, trainer.accelerator
        ref = accelerator.unwrap_model(trainer.ref_model) if trainer.ref_model is not None else None
        trl_compat.keep_model_unwrapped(accelerator, trainer.model)  # gradients are the backend's to reduce
        return cls(
            rollout_model=accelerator.unwrap_model(trainer.model), ref_model=ref,
            tensor_parallel_size=options["rollplex_tensor_parallel_size"],
            weight_mapping=options["rollplex_weight_mapping"],
            row_parallel_views=options["rollplex_row_parallel_views"],
            shm_all_reduce=options["rollplex_shm_all_reduce"], pooled_rollout=options["rollplex_pooled_rollout"],
            use_vllm=trainer.use_vllm, split_vision=options["rollplex_split_vision"],
            overlap=options["rollplex_overlap"],
            activation_recompute=bool(trainer.args.gradient_checkpointing), seed=trainer.args.seed,
            record=lambda key, value: trl_compat.metrics(trainer, True)[key].append(value),
            is_main_process=accelerator.is_main_process)

    def _bind_rollout(self, mode: str, views: str = "off", use_vllm: bool = False, log: bool = True):
        """The rollout model's weights bound to the training parameters (rollplex_weight_mapping): mapped onto
        every TP rank's shared shards where it can run (`backends/megatron/mapped_weights.py`), else views of the
        local shards plus an all-gather rebuild (`rollout_weights.py`). Returns (binding, why not mapped or None);
        the same choice on every TP rank. ``views`` (rollplex_row_parallel_views): the mapped row-parallel weights
        read in place by split-K Linears (`split_k.py`), not with vLLM (whose engine copies every weight)."""
        from rollplex_trl.backends.megatron import mapped_weights
        from rollplex_trl.backends.megatron.rollout_weights import LiveRolloutWeights
        from rollplex_trl.sharding import model_spec_from_config

        # every tensor of the rollout model, vision tower included (the policy's own spec covers the LLM only)
        spec, g = model_spec_from_config(self._rollout_model.config), self.groups
        reason = "rollplex_weight_mapping='off'"
        if views == "on" and use_vllm:
            raise ValueError("rollplex_row_parallel_views='on' reads the weights through the transformers rollout "
                             "model; with use_vllm=True the engine copies every weight: use 'auto' or 'off'")
        if mode != "off":
            train = [p for _, p in self.policy.named_parameters()]
            mapping = mapped_weights.plan_mapping(
                spec=spec, options=self.policy.options, rollout_model=self._rollout_model, train_params=train,
                tp_rank=g.tp_rank, cuda_allowed=mode == "on", row_parallel_views=views != "off" and not use_vllm)
            reason = mapped_weights.agree(mapping if isinstance(mapping, str) else None, g.tp_group, g.tp_size)
            if reason is None and mapping.split_k_note is not None:
                if views == "on":
                    raise RuntimeError(f"rollplex_row_parallel_views='on' cannot serve this model: "
                                       f"{mapping.split_k_note}; use 'auto' or 'off'")
                if log:  # the same on every rank: said once
                    logger.warning("rollplex: row-parallel weights copied after each step, not read in place: %s",
                                   mapping.split_k_note)
            if reason is None:
                return mapped_weights.MappedRolloutWeights(mapping, spec, self._rollout_model, self._train_param,
                                                           g.tp_rank, g.tp_group, g.tp_size, g.dp_rank), None
            if mode == "on":
                raise RuntimeError(f"rollplex_weight_mapping='on' cannot map the rollout weights: {reason}; use "
                                   "'auto' or 'off'")
        if views == "on":
            raise RuntimeError(f"rollplex_row_parallel_views='on' needs the weight mapping, which is off: {reason}")
        return LiveRolloutWeights(spec, self.policy.options, self._rollout_model, self._train_param, g.tp_rank,
                                  g.tp_group), reason

    def _route_all_reduce(self, mode: str, device: torch.device):
        """The TP group's layer all-reduces through shared memory (rollplex_shm_all_reduce; shm_all_reduce.py)
        where it can run; returns (the all-reduce or None, what the log says). The same choice on every TP rank."""
        from rollplex_trl import megatron_compat
        from rollplex_trl.backends.megatron.shm_all_reduce import (
            SharedMemoryAllReduce,
            refuse_unordered_machine,
            shm_all_reduce_reason,
        )

        g = self.groups
        if g.tp_size == 1:
            return None, "none (t = 1)"
        if mode == "off":
            return None, "gloo (rollplex_shm_all_reduce='off')"
        if mode == "on":  # not x86: a ValueError on every rank of the group alike (one host), before any collective
            refuse_unordered_machine()
        reason = shm_all_reduce_reason(device, g.tp_group, g.tp_size)
        if reason is not None:
            if mode == "on":
                raise RuntimeError(f"rollplex_shm_all_reduce='on' cannot run: {reason}; use 'auto' or 'off'")
            return None, f"gloo ({reason})"
        all_reduce = SharedMemoryAllReduce(g.tp_group)
        self._undo_all_reduce = [megatron_compat.route_tensor_parallel_all_reduce(g.tp_group, all_reduce)]
        return all_reduce, "shared memory (rollplex_shm_all_reduce)"

    def _pool_rollout(self, mode: str, device: torch.device, use_vllm: bool, overlap: str):
        """The transformers rollout on the TP group's first rank with the group's threads (rollplex_pooled_rollout;
        pooled_rollout.py) where it applies; returns (the pool or None, what the log says). The same on every rank."""
        from rollplex_trl.backends.megatron.pooled_rollout import PooledRollout, pooled_rollout_reason

        g = self.groups
        if g.tp_size == 1:
            return None, "one rank per TP group (t = 1)"
        if mode == "off":
            return None, "every TP rank decodes (rollplex_pooled_rollout='off')"
        reason = pooled_rollout_reason(device, g.tp_group, g.tp_size, use_vllm=use_vllm, overlap=overlap)
        if reason is not None:
            if mode == "on":
                raise RuntimeError(f"rollplex_pooled_rollout='on' cannot run: {reason}; use 'auto' or 'off'")
            return None, f"every TP rank decodes ({reason})"
        pool = PooledRollout(g.tp_group, g.tp_rank, g.tp_size)
        return pool, (f"the TP group's first rank decodes with {pool.pooled_threads} threads "
                      "(rollplex_pooled_rollout)")

    def _split_vision(self, mode: str):
        """The vision tower's items spread over the TP ranks (rollplex_split_vision; vision_split.py) where it
        applies, on the policy and the reference; returns (the split or None, what the log says)."""
        from rollplex_trl.backends.megatron.vision_split import VisionSplit

        g = self.groups
        reason = ("t = 1" if g.tp_size == 1 else "no vision tower" if self.policy.visual is None
                  else "rollplex_split_vision='off'" if mode == "off" else None)
        if reason is not None:
            if mode == "on":
                raise ValueError(f"rollplex_split_vision='on' cannot apply: {reason}; use 'auto' or 'off'")
            return None, f"replicated on every TP rank ({reason})"
        if self.all_reduce is not None:
            all_reduce = self.all_reduce
        else:
            def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
                torch.distributed.all_reduce(tensor, group=g.tp_group)
                return tensor
        split = VisionSplit(tp_rank=g.tp_rank, tp_size=g.tp_size, all_reduce=all_reduce)
        for model in (self.policy, self.ref):
            if model is not None:
                model.vision_split = split
        return split, f"items split over the {g.tp_size} TP ranks (rollplex_split_vision)"

    def _train_param(self, group, spec_index: int, name: str) -> nn.Parameter:
        if name.startswith("visual."):
            return self.policy.visual.get_parameter(name.removeprefix("visual."))
        return self.policy.gpt.get_parameter(name.removeprefix("language_model."))

    # ---- the TrainingBackend interface (backends/base.py) over the methods below ----------------------------------

    def trained_model(self, model: nn.Module) -> nn.Module:
        return self.policy

    def prefix_job_models(self, policy: nn.Module, ref: nn.Module | None, *, training: bool
                          ) -> tuple[nn.Module, nn.Module | None, dict[str, Any]]:
        """The Megatron models, built by its passes (a collective over the TP group)."""
        return (self.policy, self.ref if ref is not None else None,
                {"precompute": functools.partial(self.precompute_prefix, training=training)})

    def window_weights(self) -> list[torch.Tensor]:
        return [p for _, p in self.trainable()]  # what the window's passes read: the shards, the vision copy

    def build_actor_prefix(self) -> Callable[..., Any]:
        return _megatron_actor_prefix

    def cascade_unsupported(self, causal_lm: nn.Module, device: torch.device) -> str | None:
        return "the Megatron backend has its own suffix pass (backends/megatron/prefix.py)"

    def generate(self, rollout: Callable[[Any], tuple[list[list[int]], Any]], peer: Callable[[Any], None]
                 ) -> tuple[list[list[int]], Any]:
        """The on-policy barrier, then one view of the completions per TP group: every rank decodes, or (pooled)
        the group's first rank with the group's threads while its peers run the decode window only (its prefix
        jobs are TP collectives)."""
        self.sync_rollout()
        pool = self.rollout_pool
        if pool is None:
            completion_ids, logprobs = rollout(None)
        elif pool.decodes:
            with pool.decoding():
                completion_ids, logprobs = rollout(pool)
        else:
            peer(pool)
            completion_ids = logprobs = None
        return self.share_completions(completion_ids, logprobs)

    def prefill_serves_actor(self, *, training: bool) -> bool:
        return self.rollout_prefill(training=training) is not None

    def decode_weight_casts(self, policy: nn.Module, *, concurrent_graph_job: bool, sharded: bool
                            ) -> contextlib.AbstractContextManager:
        # the whole rollout model is frozen, and the window's jobs run the Megatron models' own parameters
        return self.rollout_casts_cached()

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        return self.grad_norm(max_norm)

    def after_checkpoint_load(self, model: nn.Module) -> None:
        self.reload_from_rollout(model)

    def save_optimizer_state(self, optimizer: torch.optim.Optimizer, folder: str) -> None:
        self.save_optimizer_shard(optimizer, folder)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, folder: str) -> None:
        self.load_optimizer_shard(optimizer, folder)

    def wrap_sampler(self, sampler: Sampler, loader_batch_size: int, *, generation_batches: bool) -> Sampler:
        """TP: the t ranks of a TP group get the same rows (`TensorParallelReplicaSampler`)."""
        from rollplex_trl import trl_compat

        t = self.groups.tp_size
        if t == 1:
            return sampler
        if generation_batches and isinstance(sampler, trl_compat.RepeatSampler):
            # TRL sized the generation batch for the world; the distinct rows are those of the DP ranks
            if sampler.batch_size % t:
                raise ValueError(f"the generation batch of {sampler.batch_size} prompts cannot be split over "
                                 f"rollplex_tensor_parallel_size={t} without splitting a group; choose "
                                 "per_device_train_batch_size / steps_per_generation so it divides")
            sampler.batch_size //= t
        return TensorParallelReplicaSampler(sampler, loader_batch_size, t)

    def close(self) -> None:
        self.release_process_groups()

    # ---- optimizer ----------------------------------------------------------------------------------------------

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.policy.named_parameters() if p.requires_grad]

    def create_optimizer(self, args: Any) -> torch.optim.Optimizer:
        # optim="adamw_torch_fused" (transformers' default, what the hf backend builds) takes torch's fused kernel
        # here too: the same arithmetic as the hf backend's optimizer, and on CPU ~5x faster than the per-tensor loop
        optimizer = torch.optim.AdamW(_decay_groups(self.trainable(), args.weight_decay), lr=args.learning_rate,
                                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                      fused=True if args.optim == "adamw_torch_fused" else None)
        optimizer.register_step_post_hook(self._after_optimizer_step)
        return optimizer

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # The Trainer zeroes the grads of `self.model` (the rollout model, which has none): ours are zeroed here.
        self.policy.zero_grad(set_to_none=True)
        self._reduced = False
        self.rollout.optimizer_stepped()

    # ---- checkpoints --------------------------------------------------------------------------------------------
    # The transformers model is what `save_model` writes (a from_pretrained-loadable checkpoint, synced from the
    # shards first). The optimizer state is per TP rank: the Trainer's `optimizer.pt` holds TP rank 0's (global rank
    # 0 writes it); TP rank r > 0 of DP rank 0 writes its own file next to it.

    def optimizer_file(self, folder: str, tp_rank: int | None = None) -> str:
        import os

        r = self.groups.tp_rank if tp_rank is None else tp_rank
        return os.path.join(folder, f"optimizer-tp{r}-of-{self.groups.tp_size}.pt")

    def save_optimizer_shard(self, optimizer: torch.optim.Optimizer, folder: str) -> None:
        if self.groups.dp_rank == 0 and self.groups.tp_rank > 0:
            import os

            os.makedirs(folder, exist_ok=True)  # the main process may not have created it yet
            torch.save(optimizer.state_dict(), self.optimizer_file(folder))

    def load_optimizer_shard(self, optimizer: torch.optim.Optimizer, folder: str) -> None:
        import os

        if self.groups.tp_rank == 0:
            return  # the Trainer loaded optimizer.pt
        path = self.optimizer_file(folder)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: the optimizer state of TP rank {self.groups.tp_rank} is missing; this "
                                    f"checkpoint was not written by a rollplex_tensor_parallel_size="
                                    f"{self.groups.tp_size} run (resume with the t it was saved with)")
        optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def reload_from_rollout(self, rollout_model: nn.Module) -> None:
        """After the Trainer loaded a checkpoint into the transformers model: the training shards from it (the
        aliased tensors were loaded in place already; the copied ones were not)."""
        from rollplex_trl.backends.megatron import weights
        from rollplex_trl.backends.megatron.split_k import logical_parameters

        hf = logical_parameters(rollout_model)  # split-K weights in their (out, in) shape
        state = weights.megatron_state(self.policy.spec, self.policy.options, self.groups.tp_rank, hf)
        with torch.no_grad():
            for name, param in self.policy.gpt.named_parameters():
                param.copy_(state[name].reshape(param.shape))
            if self.policy.visual is not None:
                for name, param in self.policy.visual.named_parameters():
                    param.copy_(hf[f"model.visual.{name}"])
        # The loader may have replaced tensors instead of writing into them (which would silently end their
        # aliasing): bind the rollout model to the training parameters again, at the same weight version.
        from rollplex_trl.backends.megatron.mapped_weights import MappedRolloutWeights
        from rollplex_trl.backends.megatron.rollout_weights import LiveRolloutWeights

        if isinstance(self.rollout, MappedRolloutWeights):
            self.rollout.bind(rollout_model)  # the shards stay where they are mapped; the copied tensors refresh
            return
        version = self.rollout.version
        self.rollout = LiveRolloutWeights(self.rollout.spec, self.policy.options, rollout_model, self._train_param,
                                          self.groups.tp_rank, self.groups.tp_group)
        self.rollout.version = self.rollout.synced_version = version

    # ---- gradients ----------------------------------------------------------------------------------------------

    def grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Average over the DP group and give the TP peers the first rank's replicated gradients (once per step),
        then the global norm over TP shards; clip if max_norm > 0."""
        from rollplex_trl.backends.megatron import (
            average_data_parallel_gradients,
            clip_grad_norm_tensor_parallel,
            share_replicated_gradients,
            sum_vision_gradients,
        )

        params = [p for _, p in self.trainable()]
        if not self._reduced:
            if self.vision_split is not None:  # each rank's tower gradients hold its own items: add them over TP
                sum_vision_gradients(self.policy.visual.parameters(), self.groups, self.vision_split.all_reduce)
            average_data_parallel_gradients(params, self.groups)
            share_replicated_gradients(params, self.groups)  # replicas step alike whatever the kernels rounded
            self._reduced = True
        return clip_grad_norm_tensor_parallel(params, max_norm, self.groups, self.policy.duplicate_rows)

    # ---- rollout ------------------------------------------------------------------------------------------------

    def sync_rollout(self) -> None:
        """The on-policy barrier: the rollout model holds the last optimizer step's weights before it generates."""
        stats = self.rollout.sync()
        if stats is not None:
            self.record("rollplex/sync_bytes_copied", float(stats.bytes_copied))
            self.record("rollplex/sync_bytes_aliased", float(stats.bytes_aliased))
            self.record("rollplex/weight_sync_s", stats.seconds)
        self.rollout.check_fresh()

    def rollout_casts_cached(self) -> contextlib.AbstractContextManager:
        """Around the transformers rollout's decode steps under autocast: its casts of the frozen rollout model's
        weights kept across the steps (backends/megatron/rollout_weights.py `autocast_caches_weights`)."""
        from rollplex_trl.backends.megatron.rollout_weights import autocast_caches_weights

        return autocast_caches_weights(self._rollout_model)

    def release_process_groups(self) -> None:
        """The end of the run (`trainer.end()`): the rollout model takes the last weights (a collective at t > 1,
        so before the groups go), then this backend drops every reference to megatron-core's groups (its models
        hold them too). The transformers model keeps the trained weights; the backend cannot train after this."""
        self.sync_rollout()
        from rollplex_trl.backends.megatron import release_model_parallel

        if self.all_reduce is not None:
            for undo in self._undo_all_reduce:
                undo()
            self.all_reduce.close()
            self.all_reduce = None
        if self.rollout_pool is not None:
            self.rollout_pool.close()
            self.rollout_pool = None
        release_model_parallel()
        self.policy = self.ref = self.rollout = self.groups = None

    def share_completions(self, completion_ids: list[list[int]] | None, logprobs: Any) -> tuple[list[list[int]], Any]:
        """The TP group's first rank's completions on every rank of the group. After a pooled rollout (only the
        first rank sampled) its RNG state too: TRL shuffles the batch with it next, and the TP ranks must agree."""
        if self.groups.tp_size == 1:
            return completion_ids, logprobs
        pooled = self.rollout_pool is not None
        box = [completion_ids, logprobs, torch.get_rng_state() if pooled else None]
        source = dist.get_global_rank(self.groups.tp_group, 0) if self.groups.tp_group is not None else 0
        dist.broadcast_object_list(box, src=source, group=self.groups.tp_group)
        if pooled and self.groups.tp_rank != 0:
            torch.set_rng_state(box[2])
        return box[0], box[1]

    # ---- the actor's prefix per accumulation window (prefix/actor.py drives it) -----------------------------------

    def actor_suffix_logps(self, policy, state, row_to_prompt, completion_ids, completion_mask, *,
                           temperature: float, compute_entropy: bool):
        from rollplex_trl.backends.megatron.prefix import megatron_suffix_logps

        policy.train(True)
        logps, entropies = megatron_suffix_logps(policy, state, row_to_prompt, completion_ids, completion_mask,
                                                 temperature=temperature, compute_entropy=compute_entropy)
        return _zero_padding(logps, completion_mask), _zero_padding(entropies, completion_mask)

    def precompute_prefix(self, model, prompt_ids, prompt_mask, rows, *, keep_graph: bool, prompts_per_chunk: int,
                          training: bool):
        """The decode window's prefix job on this backend (overlap/schedule.py `PrefixJobs.precompute`): the
        states the scoring passes (`precomputed`) and the actor window take, built as those passes would build
        them (the same train/eval mode as `logps_and_entropies`: the reference in eval, the policy as the
        trainer). A collective over the TP group: every rank runs the same jobs in the same order."""
        from rollplex_trl.backends.megatron.prefix import megatron_precompute_prefix

        model.train(training and model is not self.ref)
        return megatron_precompute_prefix(model, prompt_ids, prompt_mask, rows, keep_graph=keep_graph,
                                          prompts_per_chunk=prompts_per_chunk)

    def rollout_prefill(self, *, training: bool) -> BackendPrefill | None:
        """How the transformers rollout prefills its unique prompts on this backend (a `BackendPrefill` for
        `generate_with_shared_prefill(prefill=)`, prefix/generation.py), or None where it keeps its own prefill.

        The policy's prefix pass (`run_megatron_prefix`, the actor's own prefix: the same function, mode and inputs
        as the decode window's actor job) instead of the rollout model's: the weights are the same (the on-policy
        barrier ran), and a prefill kept for the actor window then is the actor's prefix, so the prompt's forward
        runs once per step instead of twice. At t > 1 it is a TP collective, and each rank holds its share of the
        KV heads: the decode reads them gathered (`gather_kv_heads`, through the shared-memory all-reduce where
        it runs); the pooled rollout's peers run the same prefill (`TrainerRollout.peer`),
        and the first rank runs it with its own threads, as they do.

        M-RoPE models only: the decode steps continue positions from the state's `last_positions` (`rope_deltas`)
        and RoPE depends on position differences only, so Megatron numbering a left-padded prompt's columns from 0
        gives the K/V HF's padding-aware numbering gives. Qwen2's 1-D RoPE decode numbers a padded row's new
        tokens from its first real token, which Megatron's column-counting prefix does not match."""
        if not self.policy.is_vl:
            return None
        from rollplex_trl.backends.megatron.prefix import gather_kv_heads, run_megatron_prefix

        policy, groups, pool = self.policy, self.groups, self.rollout_pool

        def run(prompt_ids, prompt_mask, rows, *, keep_graph: bool):
            policy.train(training)
            return run_megatron_prefix(policy, prompt_ids, prompt_mask, rows, keep_graph=keep_graph)

        def for_decode(state):
            return gather_kv_heads(state, groups, self.all_reduce)

        # the pooled rollout's first rank prefills inside its decoding() (the group's threads): a collective with
        # peers running their own threads, so its own here
        return BackendPrefill(run=run, for_decode=for_decode,
                              context=pool.with_own_threads if pool is not None else contextlib.nullcontext)

    # ---- log-probs ----------------------------------------------------------------------------------------------

    def logps_and_entropies(self, model: nn.Module | None = None, *, reference: bool, input_ids: torch.Tensor,
                            attention_mask: torch.Tensor, logits_to_keep: int, batch_size: int | None,
                            temperature: float, compute_entropy: bool, rows: Sequence[PreparedPrompt] | None,
                            vision_kwargs: dict[str, Any], autocast: Callable[[], Any], training: bool,
                            share_prefix: bool = False, prompts_per_chunk: int = 8, precomputed: Any = None,
                            compute_aux_loss: bool = False):
        """TRL's `_get_per_token_logps_and_entropies` on the Megatron model: with `share_prefix`, each unique
        prompt's prefix once and the completions against its K/V (backends/megatron/prefix.py; exact, gradients
        included), else the full rows chunked like TRL's. `precomputed`: the prefix states the decode window built
        for these prompts (`precompute_prefix`). Returns (log-probs, entropies, unique prompts or None). `model`
        (the transformers model TRL passes) is not run: the Megatron copy of the policy or reference is."""
        model = self.ref if reference else self.policy
        if model is None:
            raise RuntimeError("internal error: reference log-probs requested without a reference model")
        model.train(training and not reference)
        if share_prefix:
            from rollplex_trl.backends.megatron.prefix import megatron_shared_prefix_logps

            with autocast():
                logps, entropies, prompts = megatron_shared_prefix_logps(
                    model, input_ids, attention_mask, logits_to_keep, rows, temperature=temperature,
                    compute_entropy=compute_entropy, prompts_per_chunk=prompts_per_chunk, precomputed=precomputed)
            completion_mask = attention_mask[:, -logits_to_keep:]
            return _zero_padding(logps, completion_mask), _zero_padding(entropies, completion_mask), prompts
        batch_size = batch_size or input_ids.size(0)
        prompt_length = input_ids.size(1) - logits_to_keep
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            end = min(start + batch_size, input_ids.size(0))
            ids, mask = input_ids[start:end], attention_mask[start:end]
            if rows is not None:
                chunk = list(rows[start:end])
                vision = vision_inputs(chunk, ids.device)
                vision["mm_token_type_ids"] = token_type_ids(chunk, prompt_length, ids.size(1), ids.device)
            else:
                vision = _chunk_vision(vision_kwargs, start, end, input_ids.size(0))
            with autocast():
                logps, entropies = model.token_logps(ids, mask, logits_to_keep, temperature=temperature,
                                                     compute_entropy=compute_entropy, **vision)
            all_logps.append(logps)
            if compute_entropy:
                all_entropies.append(entropies)
        completion_mask = attention_mask[:, -logits_to_keep:]
        entropies = torch.cat(all_entropies) if compute_entropy else None
        return _zero_padding(torch.cat(all_logps), completion_mask), _zero_padding(entropies, completion_mask), None


def _zero_padding(values: torch.Tensor | None, completion_mask: torch.Tensor) -> torch.Tensor | None:
    """Padded completion positions hold 0, as TRL's fused head gives them (every loss term masks them; metrics and
    any consumer that sums unmasked see the same numbers on both backends)."""
    return None if values is None else values.masked_fill(completion_mask == 0, 0.0)


def _megatron_actor_prefix(policy, prompt_ids, prompt_mask, rows, *, keep_graph: bool):
    """The actor window's prefix on the Megatron policy (`ActorWindow(build_prefix=)`)."""
    from rollplex_trl.backends.megatron.prefix import run_megatron_prefix

    return run_megatron_prefix(policy, prompt_ids, prompt_mask, rows, keep_graph=keep_graph)


def _chunk_vision(vision_kwargs: dict[str, Any], start: int, end: int, rows: int) -> dict[str, Any]:
    """TRL's image inputs for rows [start, end): its per-row tensors sliced as TRL slices them (pixel_values are
    flat over images, cut by image_grid_thw)."""
    kwargs = {k: v for k, v in vision_kwargs.items() if v is not None}
    if not kwargs:
        return {}
    if start == 0 and end == rows:
        return {k: kwargs[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in kwargs}
    unsupported = sorted(set(kwargs) - {"pixel_values", "image_grid_thw", "mm_token_type_ids", "num_images"})
    if unsupported:
        raise NotImplementedError(f"Megatron backend: vision inputs {unsupported} are not supported yet")
    out: dict[str, Any] = {}
    grid = kwargs.get("image_grid_thw")
    if grid is not None:
        per_row = kwargs.get("num_images") or [1] * rows
        first, last = sum(per_row[:start]), sum(per_row[:end])
        sizes = grid.prod(-1)
        out["image_grid_thw"] = grid[first:last]
        out["pixel_values"] = kwargs["pixel_values"][int(sizes[:first].sum()):int(sizes[:last].sum())]
    if "mm_token_type_ids" in kwargs:
        out["mm_token_type_ids"] = kwargs["mm_token_type_ids"][start:end]
    return out

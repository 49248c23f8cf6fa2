"""`PhaseMemory`: the memory plan acting in every training step (`rollplex_memory="on"`, or `"auto"` where it pays).

What moves at which phase boundary (phases: rollout -> score -> train -> optimizer -> sync -> idle, marked by
`MemoryPhaseCallback` and by the `rollout` wrap around generation, see `RollplexGRPOTrainer._setup_memory_ledger`):

    object                         class        on the compute device           elsewhere
    policy weights                 regenerable  always (read by every phase)    -
    reference weights (beta > 0)   regenerable  the reference pass (score), and  host arena (CPU) / pinned host
                                                its prefix job in the rollout's buffers (CUDA), restored
                                                decode window (overlap)         bit-exactly before use
    optimizer state (AdamW m, v)   permanent    two chunks at a time, inside    host arena / pinned host memory
                                                the optimizer step
    gradients                      phase-local  train -> optimizer              dropped at the sync boundary
    optimizer slots                phase-local  the optimizer step              freed at its end
    actor prefix (boundary)        boundary     train                           freed (registered by the ledger)
    actor's saved activations      phase-local  from their forward to their     host arena (CPU) / pinned host
    (`rollplex_offload_activations`)            backward read                   memory (CUDA); where the plan says
                                                                                the actor would not fit, or "on"

Under TRL's defaults (optim="adamw_torch_fused", beta=0, bf16, gradient checkpointing) there is no reference model:
what moves is the fused AdamW's state (streamed chunk by chunk, each chunk through torch's fused kernel; on CUDA
that path has never run), the gradients dropped at the sync boundary, and the actor's activations where "auto"
finds they would not fit. What cannot move is never silently kept under a forced "on": an optimizer that cannot
stream, or a reference with `sync_ref_model=True`, raises at construction (`KeptResident.refusal`); "auto" keeps it
resident, says so once, and counts only what will move (`moved_bytes`).

"Offloaded" on CPU means what it means on a GPU: the storage of every tensor is resized to zero bytes (FSDP's move;
tensor objects, `nn.Parameter` identity and views stay valid) and the bytes wait in a `HostArena`, a file in
`/dev/shm` that is never mapped into the process, so the process's resident set really drops (measured by the
ledger's `rollplex/mem_rss_peak_<phase>_bytes`). /dev/shm is RAM too: the bytes leave the process, not the
machine (benchmarks/bench_memory.py reports both). Every move is a byte copy: the numbers of a run are those of the
same run with memory off (tests/memory/test_phase_memory.py).

Hooks in the trainer (four small ones; see `RollplexGRPOTrainer`): the component is built at the end of `__init__`
(`PhaseMemory.build(trainer)`), `create_optimizer` takes `phase_memory.create_optimizer(trainer, model)` (a
`StreamedOptimizer` around the optimizer transformers would build; `None` where "auto" keeps it resident), the reference
pass runs inside `phase_memory.reference(model is self.ref_model)`, and `TrainerRollout.prefix_jobs` returns
`phase_memory.prefix_jobs(jobs)` (the reference prefix job holds the reference weights while it runs).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from rollplex_trl.memory.lifetime import LifetimeClass, Phase, Placement
from rollplex_trl.memory.registry import MemoryObject
from rollplex_trl.memory.saved_tensors import SavedTensorOffload
from rollplex_trl.memory.storage import HostArena, TensorGroup, release_free_memory
from rollplex_trl.memory.streamed_optimizer import StreamedOptimizer, register_streamed_optimizer
from rollplex_trl.notices import notice
from rollplex_trl.torch_compat import storage_key, tensor_storage_key

# Optimizers whose state is per parameter and elementwise: chunked steps are bit-identical to one step (fused and
# foreach variants included: each chunk runs the same kernel).
_STREAMABLE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop)
_STREAMABLE_OPTIMS = "optim='adamw_torch_fused' (TRL's default), 'adamw_torch', 'sgd', 'adagrad' or 'rmsprop'"
# "auto": on when weights + reference + gradients + optimizer state would take more than this share of the device
# (CPU: of the host's RAM) with nothing moved, and something would actually move.
AUTO_PRESSURE = 0.5
CPU_CHUNK_BYTES = 16 << 20
CUDA_CHUNK_BYTES = 512 << 20
# Saved activations smaller than this stay where they are (the copies' fixed cost would outweigh the bytes)
OFFLOAD_MIN_BYTES = 64 << 10


def _tensor_bytes(tensors) -> int:
    """Logical bytes (numel x element size), whether or not the storage is on the compute side now."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen.setdefault(storage_key(s), s.nbytes())
    return sum(seen.values())


def _device_capacity(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass(frozen=True)
class KeptResident:
    """Something `rollplex_memory` would move but cannot in this trainer: what, why, and the setting that would let
    it move. "on" refuses to construct with one; "auto" keeps it resident and logs it once."""

    what: str
    reason: str
    fix: str

    def refusal(self) -> str:
        return (f"rollplex_memory='on' cannot move the {self.what}: {self.reason}. Set {self.fix}, or "
                f"rollplex_memory='auto' to keep it resident")


def _reference_model(trainer: Any) -> Any:
    """The separate reference model, or None (beta = 0, or PEFT: the reference is the policy with adapters off)."""
    return trainer.ref_model if trainer.beta != 0.0 else None


def _optimizer_cls_and_kwargs(trainer: Any, model: Any = None) -> tuple[Any, dict[str, Any]]:
    """What transformers' `create_optimizer` would build (class and keyword arguments), without building it."""
    if trainer.optimizer_cls_and_kwargs is not None:
        optimizer_cls, kwargs = trainer.optimizer_cls_and_kwargs
    else:
        optimizer_cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model if model is None
                                                                     else model)
    return optimizer_cls, dict(kwargs)


def _optimizer_kept(trainer: Any) -> KeptResident | None:
    """Why the trainer's optimizer state cannot be streamed (None: it streams)."""
    from transformers.trainer_optimizer import is_optimizer_factory

    optim = getattr(trainer.args, "optim", None)
    optim = getattr(optim, "value", optim)
    if trainer.optimizer is not None:  # passed in through `optimizers=(...)`: built before the trainer could stream it
        if isinstance(trainer.optimizer, StreamedOptimizer):
            return None
        return KeptResident("optimizer state", f"the optimizer was passed in built "
                            f"({type(trainer.optimizer).__name__}, optimizers=(...))",
                            "optimizers=(StreamedOptimizer(...), scheduler) or let the trainer build it with "
                            + _STREAMABLE_OPTIMS)
    optimizer_cls, kwargs = _optimizer_cls_and_kwargs(trainer)
    name = getattr(optimizer_cls, "__name__", repr(optimizer_cls))
    if (is_optimizer_factory(optimizer_cls) or optimizer_cls not in _STREAMABLE
            or any(k in kwargs for k in ("params", "model", "optimizer_dict"))):
        return KeptResident("optimizer state", f"optim={optim!r} builds {name}, whose state is not streamed (per-"
                            "parameter elementwise torch optimizers only)", _STREAMABLE_OPTIMS)
    if kwargs.get("capturable"):
        return KeptResident("optimizer state", f"optim={optim!r} builds {name}(capturable=True), whose step keeps "
                            "its counters on the device for CUDA graphs", "optim_args without capturable=True")
    return None


def _reference_kept(trainer: Any) -> KeptResident | None:
    """Why the reference model cannot be offloaded (None: it is, or there is none)."""
    if _reference_model(trainer) is None or not getattr(trainer.args, "sync_ref_model", False):
        return None
    return KeptResident("reference model", "sync_ref_model=True writes the policy into it every "
                        "ref_model_sync_steps steps", "sync_ref_model=False")


def _state_tensors_per_param(optimizer_cls: Any, kwargs: dict[str, Any]) -> int:
    """State tensors the size of its parameter that the optimizer keeps (what streaming moves)."""
    if not isinstance(optimizer_cls, type) or issubclass(optimizer_cls, (torch.optim.Adam, torch.optim.AdamW)):
        return 2 + bool(kwargs.get("amsgrad"))  # Adam(W); an estimate for factories and other optimizers
    if issubclass(optimizer_cls, torch.optim.SGD):
        return int(bool(kwargs.get("momentum")))
    if issubclass(optimizer_cls, torch.optim.RMSprop):
        return 1 + bool(kwargs.get("momentum")) + bool(kwargs.get("centered"))
    if issubclass(optimizer_cls, torch.optim.Adagrad):
        return 1
    return 2


class _Gradients:
    """The policy's gradients as a registry object: they exist from the backward to the optimizer step; leaving that
    window (the sync boundary) drops them, as `zero_grad(set_to_none=True)` would a moment later."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params

    def nbytes(self) -> int:
        return _storage_bytes(p.grad for p in self.params if p.grad is not None)

    def to_device(self) -> None:  # produced by the backward, not loaded
        pass

    def to_host(self) -> None:
        raise RuntimeError("gradients are phase-local: dropped, never parked")

    def free(self) -> None:
        for p in self.params:
            p.grad = None


def _adopt_resizable(params: list[torch.nn.Parameter]) -> None:
    """Give every parameter a storage that can be resized (weights loaded from safetensors come in storages that
    cannot); parameters sharing a storage keep sharing the new one. Done once, before the first offload."""
    by_storage: dict[int, list[torch.nn.Parameter]] = {}
    for p in params:
        by_storage.setdefault(tensor_storage_key(p), []).append(p)
    with torch.no_grad():
        for group in by_storage.values():
            old = group[0].untyped_storage()
            if old.resizable():
                continue
            new = torch.empty(old.nbytes(), dtype=torch.uint8, device=old.device)
            new.copy_(torch.empty(0, dtype=torch.uint8, device=old.device).set_(old))
            storage = new.untyped_storage()
            for p in group:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device).set_(storage, p.storage_offset(), p.size(),
                                                                             p.stride())
    release_free_memory()


def vllm_sleep_for_memory(args: Any, options: dict[str, Any], cuda: bool) -> str | None:
    """With `rollplex_memory="on"`, the colocated vLLM engine's rollout-only memory (its KV cache, and its weights
    where they are not shared) is released before training and restored before the next rollout: TRL's
    `vllm_enable_sleep_mode`, which this turns on (before TRL builds the engine) where vLLM supports it. Returns the
    message to log once, or None where nothing applies. (The transformers engine's KV cache lives only inside its
    `generate` call: nothing to release.)"""
    if options.get("rollplex_memory") != "on" or not getattr(args, "use_vllm", False):
        return None
    if getattr(args, "vllm_mode", "colocate") != "colocate" or getattr(args, "vllm_enable_sleep_mode", False):
        return None  # server mode: the server owns its memory; sleep already on
    if not cuda:
        return ("rollplex_memory: vLLM's KV cache stays allocated between rollouts (vLLM's sleep mode is not "
                "supported on CPU)")
    args.vllm_enable_sleep_mode = True
    return ("rollplex_memory: vllm_enable_sleep_mode=True (the KV cache, and the weights where not shared, are "
            "released after each rollout and restored before the next)")


class PhaseMemory:
    """Acts at the phase boundaries of a `RollplexGRPOTrainer` (module docstring). `active=False` only marks the
    reference pass as the `score` phase in the ledger (for side-by-side measurements) and moves nothing."""

    def __init__(self, trainer: Any, *, active: bool = True, reason: str = "", track_rss: bool | None = None,
                 chunk_bytes: int | None = None, arena_dir: str | None = None,
                 kept: list[KeptResident] | None = None) -> None:
        from rollplex_trl.callbacks import MemoryPhaseCallback
        from rollplex_trl.memory import MemoryLedger, MemoryRegistry, ResidencyManager, wrap_in_phase
        from rollplex_trl.trl_compat import GENERATE_METHOD

        self.active = active
        self.reason = reason
        self.kept = self.kept_resident(trainer) if kept is None and active else (kept or [])
        self.device = torch.device(trainer.accelerator.device)
        cpu = self.device.type == "cpu"
        self.chunk_bytes = chunk_bytes or (CPU_CHUNK_BYTES if cpu else CUDA_CHUNK_BYTES)
        self.arena = HostArena(arena_dir) if (active and cpu) else None
        ledger = getattr(trainer, "memory_ledger", None)
        if ledger is None:  # memory on without the ledger option: the same setup, owned here
            registry = MemoryRegistry()
            ledger = MemoryLedger(registry, device=self.device)
            manager = ResidencyManager(registry, ledger)
            trainer.add_callback(MemoryPhaseCallback(manager, trainer=trainer))
            wrap_in_phase(trainer, GENERATE_METHOD, manager, "rollout")
        self.ledger = ledger
        self.registry = ledger.registry
        self.manager = ledger.manager
        if self.manager is None:
            raise RuntimeError("internal error: the memory ledger has no residency manager")
        if cpu if track_rss is None else track_rss:
            from rollplex_trl.memory.ledger import process_rss

            ledger.track_rss = process_rss() > 0  # Linux /proc only
        self.optimizer: StreamedOptimizer | None = None
        self.ref_object: MemoryObject | None = None
        self._depth = 0
        self._arena_dir = arena_dir
        self.offload_mode = trainer.rollplex.get("rollplex_offload_activations", "off") if active else "off"
        self.activation_offload: SavedTensorOffload | None = None
        self._offload_decided = self.offload_mode != "auto"
        if self.offload_mode == "on":
            self.activation_offload = self._new_activation_offload()
        self._policy_params = [p for p in trainer.accelerator.unwrap_model(trainer.model).parameters()]
        if not active:
            return
        # policy weights: resident in every phase (window [sync, optimizer] wraps around all six)
        self.registry.register("policy_weights", TensorGroup(self._policy_params), LifetimeClass.REGENERABLE,
                               Phase.SYNC, Phase.OPTIMIZER)
        trainable = [p for p in self._policy_params if p.requires_grad]
        self.registry.register("gradients", _Gradients(trainable), LifetimeClass.PHASE_LOCAL, Phase.TRAIN,
                               Phase.OPTIMIZER)
        self._register_reference(trainer)

    # --- construction ---------------------------------------------------------------------------------------------

    @classmethod
    def build(cls, trainer: Any) -> PhaseMemory | None:
        """The component the run plan asks for (`trainer.plan.memory`: trainers/plan.py decides "on"/"auto"/"off",
        refuses what a forced "on" cannot move, and logs auto's measurement once), or None."""
        plan = trainer.plan
        return cls(trainer, reason=plan.memory_reason, kept=list(plan.memory_kept)) if plan.memory else None

    @staticmethod
    def _log(trainer: Any, message: str) -> None:
        if trainer.accelerator.is_main_process:
            notice(message)

    @staticmethod
    def unsupported(trainer: Any) -> str | None:
        """Why the phase moves cannot run with this trainer (None: they can)."""
        if trainer.rollplex.get("rollplex_backend") == "megatron":
            return "the Megatron backend owns its optimizer and weights (docs/megatron.md)"
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            return "DeepSpeed/FSDP shard and move the weights and optimizer state themselves"
        return None

    @staticmethod
    def kept_resident(trainer: Any) -> list[KeptResident]:
        """What the plan would move but cannot in this trainer (an unstreamable optimizer, a synced reference)."""
        return [k for k in (_optimizer_kept(trainer), _reference_kept(trainer)) if k is not None]

    @staticmethod
    def movable_bytes(trainer: Any) -> dict[str, int]:
        """Bytes of the objects the plan handles, from the trainer's real tensors, whether or not they move here
        (`moved_bytes`). The optimizer state is estimated as its optimizer's per-parameter tensors (AdamW: two
        moments, three with amsgrad) shaped like every trainable parameter."""
        policy = list(trainer.accelerator.unwrap_model(trainer.model).parameters())
        ref = _reference_model(trainer)
        trainable = [p for p in policy if p.requires_grad]
        if trainer.optimizer is not None:
            per_param = 2  # passed in built: AdamW's two moments, as transformers' optimizers mostly are
        else:
            per_param = _state_tensors_per_param(*_optimizer_cls_and_kwargs(trainer))
        return {
            "policy_weights": _tensor_bytes(policy),
            "reference_weights": _tensor_bytes(ref.parameters()) if ref is not None else 0,
            "gradients": _tensor_bytes(trainable),
            "optimizer_state": per_param * _tensor_bytes(trainable),
        }

    @classmethod
    def moved_bytes(cls, trainer: Any) -> dict[str, int]:
        """Of `movable_bytes`, those the plan will actually move off the compute device outside their phase: the
        reference only where there is one and it is not synced, the optimizer state only where it streams."""
        sizes = cls.movable_bytes(trainer)
        kept = {k.what for k in cls.kept_resident(trainer)}
        return {"reference_weights": 0 if "reference model" in kept else sizes["reference_weights"],
                "optimizer_state": 0 if "optimizer state" in kept else sizes["optimizer_state"]}

    @classmethod
    def pays(cls, trainer: Any) -> tuple[bool, str]:
        """'auto': the moves cost copies every step, so they pay where memory is the constraint: weights, reference,
        gradients and optimizer state would take more than AUTO_PRESSURE of the device (CPU: of the RAM), and what
        would really move (`moved_bytes`) is not nothing."""
        total = sum(cls.movable_bytes(trainer).values())
        capacity = _device_capacity(torch.device(trainer.accelerator.device))
        moved = cls.moved_bytes(trainer)
        share = total / capacity if capacity else 0.0
        gib = 2**30
        why = (f"weights + reference + gradients + optimizer state = {total / gib:.2f} GiB, {share:.0%} of the "
               f"{'device' if trainer.accelerator.device.type == 'cuda' else 'host RAM'} "
               f"({capacity / gib:.0f} GiB); moving the reference ({moved['reference_weights'] / gib:.2f} GiB) and "
               f"the optimizer state ({moved['optimizer_state'] / gib:.2f} GiB) would free "
               f"{sum(moved.values()) / gib:.2f} GiB outside their phases")
        return share > AUTO_PRESSURE and sum(moved.values()) > 0, why

    def _register_reference(self, trainer: Any) -> None:
        ref = _reference_model(trainer)
        if ref is None or any(k.what == "reference model" for k in self.kept):
            return  # none to move, or kept resident ("auto" with sync_ref_model; logged by `build`)
        params = list(trainer.accelerator.unwrap_model(ref).parameters())
        if self.device.type == "cpu":
            _adopt_resizable(params)
        group = TensorGroup(params, host_device="cpu", arena=self.arena, immutable=True,
                            keep_host_copy=self.arena is None)
        # Resident for the reference pass (score); the overlap schedule's reference prefix job, which runs in the
        # rollout's decode window, holds it for the job's duration only (`prefix_jobs`).
        self.ref_object = self.registry.register("reference_weights", group, LifetimeClass.REGENERABLE, Phase.SCORE,
                                                 Phase.SCORE)
        self._place(self.ref_object, self.manager.current)

    def _place(self, obj: MemoryObject, phase: Phase | None) -> None:
        from rollplex_trl.memory.residency import _move

        dest = obj.planned_placement(phase) if phase is not None else Placement.HOST
        if obj.placement is not dest:
            _move(obj, dest)
        if phase is not None:
            obj.history.append((phase, obj.placement))

    def create_optimizer(self, trainer: Any, model: Any = None) -> StreamedOptimizer | None:
        """The optimizer transformers would build (class, hyperparameters incl. fused/foreach, weight-decay groups),
        streamed; None where it cannot stream ("auto" only: the trainer then builds its own, the state resident)."""
        if not self.active:
            return None
        if any(k.what == "optimizer state" for k in self.kept):
            return None  # "auto" with an optimizer that cannot stream ("on" refused it at construction)
        opt_model = trainer.model if model is None else model
        optimizer_cls, kwargs = _optimizer_cls_and_kwargs(trainer, opt_model)
        decay = set(trainer.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": trainer.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        self.optimizer = StreamedOptimizer(groups, optimizer_cls, chunk_bytes=self.chunk_bytes,
                                           host_arena=self.arena, compute_device=self.device, **kwargs)
        register_streamed_optimizer(self.registry, self.optimizer, self.ledger)
        return self.optimizer

    # --- the reference pass ---------------------------------------------------------------------------------------

    @contextmanager
    def reference(self, active: bool = True) -> Iterator[None]:
        """The reference pass: the `score` phase in the ledger, the reference weights resident inside it."""
        if not active or self._depth:
            yield
            return
        previous = self.manager.current
        self._depth += 1
        self._switch(Phase.SCORE)
        try:
            with self._holding_reference():
                yield
        finally:
            self._depth -= 1
            self._switch(previous)

    def _holding_reference(self):
        if self.ref_object is None:
            return contextlib.nullcontext()
        return self.manager.using(self.ref_object.name)

    def _switch(self, phase: Phase | None) -> None:
        if self.ledger is not None:
            self.ledger.end_phase()
        with self.manager._lock:
            self.manager.current = phase
            if self.ref_object is not None and self.ref_object.in_use == 0:
                self._place(self.ref_object, phase)
        if self.ledger is not None and phase is not None:
            self.ledger.begin_phase(phase)

    def prefix_jobs(self, jobs: Any) -> Any:
        """The overlap schedule's `PrefixJobs`: its reference job holding the reference weights while it runs, its
        actor job's saved activations parked (where offloading), on whichever thread runs them; the rest unchanged."""
        if self.ref_object is None and self.offload_mode == "off":
            return jobs
        return _PhaseHoldingJobs(jobs, self)

    # --- ledger vs plan -------------------------------------------------------------------------------------------

    def registered_peaks(self) -> dict[str, int]:
        """Per phase, the highest registered device-resident bytes seen (all records, not one logging window)."""
        out: dict[str, int] = {}
        for rec in self.ledger.records:
            out[rec.phase.value] = max(out.get(rec.phase.value, 0), rec.peak_bytes)
        return out

    def _plan_report(self, trainer: Any, *, prompt_len: int, completion_len: int, micro_batch: int = 1):
        """The planner's report for this trainer's model and configuration at these lengths (one process)."""
        from rollplex_trl.memory.model_dims import dims_from_config
        from rollplex_trl.memory.planner import Assumptions, Workload, plan_memory

        policy = trainer.accelerator.unwrap_model(trainer.model)
        dims = dims_from_config(policy.config, getattr(policy.config, "_name_or_path", "model"))
        element = next(policy.parameters()).element_size()
        G = trainer.num_generations
        prompts = max(1, trainer.args.per_device_train_batch_size * trainer.args.steps_per_generation // G)
        workload = Workload(train_tp=1, rollout_tp=1, num_gpus=1, batch=prompts, num_generations=G,
                            prompt_len=max(1, prompt_len), completion_len=max(1, completion_len),
                            device_mem_gib=_device_capacity(self.device) / 2**30 or 80.0,
                            micro_batch=max(1, micro_batch))
        assumptions = Assumptions(
            param_bytes=element, grad_bytes=element, master_bytes=0, moment_bytes=element,
            distributed_optimizer=False, reference_model=self.ref_object is not None,
            runtime_overhead_gib=0.0, incompatible_weight_fraction=0.0,
            optimizer_chunk_mib=max(1, self.chunk_bytes >> 20), kv_bytes=element)
        return plan_memory(dims, workload, assumptions)

    def planned(self, trainer: Any, *, prompt_len: int, completion_len: int) -> dict[str, dict[str, float]]:
        """The planner's prediction for this model and configuration, per phase, for the objects this component
        registers (policy and reference weights, gradients, optimizer state): `rollplex` (the plan acting) and
        `resident` (nothing moved: naive colocation's entries for the same objects)."""
        from rollplex_trl.memory.model_dims import dims_from_config
        from rollplex_trl.memory.planner import PHASES

        policy = trainer.accelerator.unwrap_model(trainer.model)
        dims = dims_from_config(policy.config, getattr(policy.config, "_name_or_path", "model"))
        report = self._plan_report(trainer, prompt_len=prompt_len, completion_len=completion_len)
        names = {c.name for key, c in report.components.items()
                 if key in ("actor_weights", "ref_weights", "grads", "master", "moments")}
        out = {}
        for label, plan in (("rollplex", report.plans["rollplex"]), ("resident", report.plans["naive_overlap"])):
            out[label] = {p.value: float(sum(e.nbytes for e in plan.entries if e.component in names and p in e.phases))
                          for p in PHASES}
        out["num_params"] = {"planner": float(dims.num_params()),
                             "model": float(sum(p.numel() for p in policy.parameters()))}
        return out

    # --- the actor's saved activations -----------------------------------------------------------------------------

    def _new_activation_offload(self) -> SavedTensorOffload:
        arena = HostArena(self._arena_dir) if self.device.type == "cpu" else None
        return SavedTensorOffload(host_device="cpu", min_bytes=OFFLOAD_MIN_BYTES, arena=arena)

    def decide_activation_offload(self, trainer: Any, *, prompt_len: int, completion_len: int,
                                  micro_batch: int) -> None:
        """"auto", at the first actor micro-batch: offload where the plan's train phase (weights, gradients,
        boundary state and this micro-batch's activations, every process's largest) exceeds the device."""
        if self._offload_decided:
            return
        self._offload_decided = True
        report = self._plan_report(trainer, prompt_len=prompt_len, completion_len=completion_len,
                                   micro_batch=micro_batch)
        need = report.plans["rollplex"].phase_bytes(Phase.TRAIN)
        if trainer.accelerator.num_processes > 1:
            from accelerate.utils import gather

            need = float(gather(torch.tensor([need], dtype=torch.float64, device=self.device)).max())
        capacity = _device_capacity(self.device)
        offload = capacity > 0 and need > capacity
        gib = 2**30
        self._log(trainer, f"rollplex_offload_activations='auto': {'on' if offload else 'off'}, the plan's train "
                  f"phase needs {need / gib:.2f} GiB of the {capacity / gib:.0f} GiB "
                  f"{'device' if self.device.type == 'cuda' else 'host RAM'} (prompt {prompt_len}, completion "
                  f"{completion_len}, {micro_batch} sequences per micro-batch)")
        if offload:
            self.activation_offload = self._new_activation_offload()

    def actor_activations(self):
        """The actor's forward (a micro-step's loss, the window's prefix): saved activations parked on the host."""
        if self.activation_offload is None:
            return contextlib.nullcontext()
        return self.activation_offload.hooks()

    def activations_done(self, record: Any) -> None:
        """After the backward that read them (the window's end): the parked bytes counted, the arena emptied."""
        offload = self.activation_offload
        if offload is None:
            return
        record("rollplex/mem_activations_offloaded_bytes", float(offload.parked_bytes_total))
        offload.release()

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
        if self.activation_offload is not None and self.activation_offload.arena is not None:
            self.activation_offload.arena.close()


class _PhaseHoldingJobs:
    """`PrefixJobs` whose windows' "ref" job runs inside `PhaseMemory`'s hold on the reference weights and whose
    "actor" job (the prefix graph kept for the window's backward) runs under the activation offload's hooks (they
    are thread-local: entered inside the job, on the thread that runs it)."""

    def __init__(self, jobs: Any, memory: PhaseMemory) -> None:
        self._jobs = jobs
        self._memory = memory

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jobs, name)

    def for_window(self, *args: Any, **kwargs: Any) -> list:
        def held(run, context):
            @functools.wraps(run)
            def wrapped():
                with context():
                    return run()
            return wrapped

        contexts = {"ref": self._memory._holding_reference, "actor": self._memory.actor_activations}
        return [(name, held(run, contexts[name]) if name in contexts else run)
                for name, run in self._jobs.for_window(*args, **kwargs)]


def setup_memory_ledger(trainer: Any):
    """The trainer's memory ledger (`rollplex_memory_ledger`): phases from TRL's callbacks plus a `rollout` phase
    around generation; the actor prefix (boundary state, from the window's first micro-batch to its backward) is
    registered so its bytes show in `rollplex/mem_*`."""
    from rollplex_trl import trl_compat
    from rollplex_trl.callbacks import MemoryPhaseCallback
    from rollplex_trl.memory import MemoryLedger, MemoryRegistry, ResidencyManager, wrap_in_phase

    registry = MemoryRegistry()
    ledger = MemoryLedger(registry, device=trainer.accelerator.device)
    manager = ResidencyManager(registry, ledger)
    window = trainer.actor_window
    registry.register_tensors("actor_prefix", lambda: window.boundary_tensors() if window is not None else [],
                              "boundary", "train", "train")
    trainer.add_callback(MemoryPhaseCallback(manager, trainer=trainer))
    wrap_in_phase(trainer, trl_compat.GENERATE_METHOD, manager, "rollout")
    return ledger

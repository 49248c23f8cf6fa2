"""Megatron's tensor/data-parallel groups on top of the process group accelerate or torchrun created."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroups:
    """This process's place in the TP x DP grid. TP groups are consecutive ranks (Megatron's layout): ranks
    ``[k * tp_size, (k + 1) * tp_size)`` form TP group ``k``; DP groups are the ranks with equal ``tp_rank``."""

    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup
    dp_size: int
    dp_rank: int
    dp_group: dist.ProcessGroup
    world: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_model_parallel(tensor_parallel_size: int) -> ParallelGroups:
    """Initialize megatron-core's ``parallel_state`` with TP = ``tensor_parallel_size`` (re-entrant).

    Uses the default process group when torch.distributed is initialized (gloo on CPU, nccl on GPU); otherwise
    starts a single-process gloo group on a free local port. Calling it again with the same size returns the same
    groups; a different size is an error (megatron-core keeps one global grid per process).
    """
    from megatron.core import parallel_state as ps

    import rollplex_trl.megatron_compat as compat

    t = int(tensor_parallel_size)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    world = dist.get_world_size()
    if t < 1 or world % t:
        raise ValueError(f"rollplex_tensor_parallel_size={t} must divide the number of processes ({world})")
    if ps.model_parallel_is_initialized():
        current = ps.get_tensor_model_parallel_world_size()
        if current != t:
            raise ValueError(f"megatron-core is already initialized with tensor parallel size {current}; "
                             f"rollplex_tensor_parallel_size={t} cannot change it within one process")
    else:
        compat.apply_cpu_shims()
        # The default group is already gloo on CPU, so megatron's extra gloo groups would only duplicate it.
        ps.initialize_model_parallel(tensor_model_parallel_size=t, create_gloo_process_groups=False)
        if torch.cuda.is_available():
            # NEVER RUN (no GPU here): on CUDA, attention forks megatron's CUDA RNG tracker, whose model-parallel
            # state only exists after this call (on CPU the rng_tracker shim stands in). Dropout is 0 in this
            # backend, so the seed changes no number; the trainer reseeds torch's generators afterwards.
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1234)
    return ParallelGroups(tp_size=t, tp_rank=ps.get_tensor_model_parallel_rank(),
                          tp_group=ps.get_tensor_model_parallel_group(), dp_size=ps.get_data_parallel_world_size(),
                          dp_rank=ps.get_data_parallel_rank(), dp_group=ps.get_data_parallel_group(), world=world)


def release_model_parallel() -> None:
    """Drop megatron-core's global references to its groups (``parallel_state``).

    ``destroy_process_group`` only unregisters groups; a group object still referenced keeps gloo's native threads
    running into the interpreter's final teardown, where a process can abort after a complete run. Called at the end
    of a run (``RollplexGRPOTrainer.end``), after the last collective.
    """
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()

"""Phase-aware memory management (Rollplex's first mechanism).

Every large object occupies accelerator memory only between its first latency-critical use and its last use.

- ``lifetime``: lifetime classes (boundary, permanent, regenerable, phase-local), phases, the placement rule
- ``registry`` / ``residency``: declare objects with a window of phases; ``ResidencyManager`` moves or frees them at
  phase boundaries (driven by ``rollplex_trl.callbacks.MemoryPhaseCallback`` and ``manager.phase("rollout")``)
- ``storage`` / ``cuda_vmm``: the moves (storage offload keeping tensor objects; CUDA VMM keeping addresses)
- ``streamed_optimizer``: optimizer state on the host, streamed to the device in double-buffered chunks
- ``saved_tensors``: the actor prefix's saved activations parked on the host during the decode window
- ``ledger``: per-phase peak and resident bytes by lifetime class, logged as ``rollplex/mem_*``
- ``planner`` / ``cli``: the analytic per-GPU plan behind ``rollplex-trl plan-memory``
"""

from rollplex_trl.memory.ledger import MemoryLedger
from rollplex_trl.memory.lifetime import STEP_ORDER, LifetimeClass, Phase, Placement, window
from rollplex_trl.memory.model_dims import PRESETS, ModelDims, VisionDims, from_hf_config, resolve_model
from rollplex_trl.memory.planner import Assumptions, MemoryPlanReport, Workload, plan_memory
from rollplex_trl.memory.registry import MemoryObject, MemoryRegistry
from rollplex_trl.memory.residency import ResidencyManager, wrap_in_phase
from rollplex_trl.memory.saved_tensors import SavedTensorOffload
from rollplex_trl.memory.storage import Movable, TensorGroup
from rollplex_trl.memory.streamed_optimizer import ChunkInfo, StreamedOptimizer, register_streamed_optimizer

__all__ = [
    "PRESETS",
    "STEP_ORDER",
    "Assumptions",
    "ChunkInfo",
    "LifetimeClass",
    "MemoryLedger",
    "MemoryObject",
    "MemoryPlanReport",
    "MemoryRegistry",
    "ModelDims",
    "Movable",
    "Phase",
    "Placement",
    "ResidencyManager",
    "SavedTensorOffload",
    "StreamedOptimizer",
    "TensorGroup",
    "VisionDims",
    "Workload",
    "from_hf_config",
    "plan_memory",
    "register_streamed_optimizer",
    "resolve_model",
    "window",
    "wrap_in_phase",
]

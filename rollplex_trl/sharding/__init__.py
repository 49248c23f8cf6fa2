"""Parallelism-aware weight sharing between Megatron-Core training (TP = t) and vLLM rollout (TP = r).

Layouts are declared once per parameter kind (:mod:`.models`, :mod:`.layouts`), composed mechanically into a plan
(:func:`plan_sharding`) that classifies every rollout tensor as aligned / view / copy, places rollout ranks, and lays
out training arenas; the executor (:mod:`.executor`) then builds rollout tensors as real views of training storage
(CPU: shared-memory files + mmap; CUDA: the driver's virtual-memory API) and rebuilds the rest after each step.
"""

from rollplex_trl.sharding.classify import ALIGNED, COPY, VIEW
from rollplex_trl.sharding.layouts import LayoutError
from rollplex_trl.sharding.models import PRESETS, ModelSpec, load_model_spec, model_spec_from_config, preset_config
from rollplex_trl.sharding.plan import COUNTING_RULE, ShardingOptions, ShardingPlan, plan_sharding

__all__ = [
    "ALIGNED",
    "COPY",
    "COUNTING_RULE",
    "PRESETS",
    "VIEW",
    "LayoutError",
    "ModelSpec",
    "ShardingOptions",
    "ShardingPlan",
    "load_model_spec",
    "model_spec_from_config",
    "plan_sharding",
    "preset_config",
]

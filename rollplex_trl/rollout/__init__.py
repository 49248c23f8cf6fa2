"""Rollout engines behind one interface: transformers' generate and vLLM (colocated in-process, or a server).

Nothing here imports vLLM at import time: the vLLM modules import it when an engine is built, so this package
imports in environments without vLLM (the main test environment), and the vLLM tier runs in .venv-vllm.
"""

from rollplex_trl.rollout.engine import RolloutEngine, RolloutRequest, RolloutSample, SamplingSpec, flatten_rows
from rollplex_trl.rollout.weight_sync import SyncStats, WeightSync

__all__ = ["RolloutEngine", "RolloutRequest", "RolloutSample", "SamplingSpec", "SyncStats", "WeightSync",
           "flatten_rows"]

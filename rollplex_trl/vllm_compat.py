"""The one module that touches vLLM's internals (as rollplex_trl/trl_compat.py is for TRL and transformers): a vLLM
upgrade is a review of this file plus the vLLM CPU tier (tests/vllm_cpu, `bash scripts/test_vllm.sh`), and
tests/test_compat_boundary.py fails where another module reaches into vLLM.

vLLM is imported inside the functions only: the main environment has no vLLM, and this module imports anywhere.
The version is checked where the engine is built (:func:`llm_class`), not at import.

What lives here, each with why:
- the supported version range (every name below was read in vllm-cpu 0.32's sources; constraints-vllm.txt);
- :func:`inprocess_model`: the in-process model of a colocated `LLM` (the engine keeps it under its executor's
  driver worker; vLLM has no accessor), which the exact weight sync writes in place;
- :func:`max_model_len`: the engine's context length, from its model config;
- :func:`hf_to_vllm_name`: vLLM's own renaming of an HF checkpoint name (its models' private `_map_name`);
- :func:`is_repacked`, :func:`partition_sizes`, :func:`reprocess_weights`: vLLM's CPU linear layers repack their
  weight after loading (a oneDNN/SGL handle in `cpu_linear`; `layer.weight` may be emptied); the sync stages the
  new weight and reruns the same post-load processing (`quant_method.process_weights_after_loading`).
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.version import Version

SUPPORTED_VLLM = ("0.11", "0.33")  # [min, max): pyproject's vllm>=0.11; the CPU tier runs vllm-cpu 0.32
REPACKED_ATTRIBUTE = "cpu_linear"  # set by vLLM's CPU linear methods on a layer whose weight they repacked


def check_vllm_version(found: str | None = None) -> str:
    """The installed vLLM version; ImportError when it is missing or outside the supported range."""
    if found is None:
        import vllm

        found = vllm.__version__
    low, high = SUPPORTED_VLLM
    if not Version(low) <= Version(Version(found).base_version) < Version(high):
        raise ImportError(f"rollplex_trl's vLLM engine supports vllm >={low},<{high}; found {found}. Install a "
                          f"supported version, or review rollplex_trl/vllm_compat.py against vLLM {found}.")
    return found


def llm_class() -> type:
    """vLLM's `LLM`, after the version check."""
    check_vllm_version()
    from vllm import LLM

    return LLM


def inprocess_model(llm: Any) -> torch.nn.Module:
    """The model a colocated (`external_launcher`) `LLM` runs in this process: this rank's shard."""
    worker = llm.llm_engine.model_executor.driver_worker
    worker = getattr(worker, "worker", worker)  # vLLM >= 0.2x wraps the worker
    return worker.model_runner.model


def max_model_len(llm: Any) -> int:
    """The engine's context length (what `max_model_len=None` resolved to)."""
    return llm.llm_engine.model_config.max_model_len


def hf_to_vllm_name(model: torch.nn.Module, hf_name: str) -> str | None:
    """vLLM's name for an HF checkpoint tensor (None: vLLM drops it); `hf_name` itself for models without a
    mapper."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return mapper._map_name(hf_name) if mapper is not None and hasattr(mapper, "_map_name") else hf_name


def is_repacked(module: torch.nn.Module) -> bool:
    """Whether vLLM's CPU linear method repacked this layer's weight after loading."""
    return hasattr(module, REPACKED_ATTRIBUTE)


def partition_sizes(module: torch.nn.Module) -> tuple[int, int]:
    """(output, input) size of this rank's part of a vLLM linear layer (known even when the weight was emptied)."""
    return module.output_size_per_partition, module.input_size_per_partition


def reprocess_weights(module: torch.nn.Module) -> None:
    """Rerun the layer's post-load weight processing (the CPU repacking) on its current `weight`."""
    module.quant_method.process_weights_after_loading(module)

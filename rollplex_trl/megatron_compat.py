"""The one module that touches megatron-core's internals (the upgrade surface of the Megatron backend, as
rollplex_trl/trl_compat.py is for TRL): a megatron-core upgrade is a review of this file plus
tests/megatron/test_megatron_compat.py, which fails where a shim stops being needed or stops being enough.

What lives here, each with why:
- the supported version range (checked at import, with the install hint);
- :func:`apply_cpu_shims`: what megatron-core 0.16 needs to run on a machine without CUDA. Every shim is applied
  only when ``torch.cuda.is_available()`` is False, is idempotent, and patches an attribute of a megatron-core module
  or class (never a torch global), so code outside megatron-core sees torch unchanged;
- :func:`route_tensor_parallel_all_reduce`: megatron-core's tensor-parallel all-reduces of one group through
  another implementation (the shared-memory all-reduce of backends/megatron/shm_all_reduce.py);
- :func:`core_attention_base`: megatron-core's ``DotProductAttention``, the base of the prefix pass's core
  attention (backends/megatron/prefix.py), with the attributes and ``forward`` parameters that subclass relies on.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

import torch
from packaging.version import Version

SUPPORTED_MEGATRON_CORE = ("0.16", "0.17")  # [min, max): every internal name below was read in 0.16.1's sources
INSTALL_HINT = "pip install 'rollplex-trl[megatron]'"


def check_megatron_version(found: str | None = None) -> str:
    """The installed megatron-core version; ImportError (with the install hint) when missing or unsupported."""
    if found is None:
        try:
            found = version("megatron-core")
        except PackageNotFoundError:
            raise ImportError(f"rollplex_backend='megatron' needs megatron-core; install it with {INSTALL_HINT}") \
                from None
    low, high = SUPPORTED_MEGATRON_CORE
    if not Version(low) <= Version(found) < Version(high):
        raise ImportError(f"rollplex_trl's Megatron backend supports megatron-core >={low},<{high}; found {found}. "
                          f"Install a supported version ({INSTALL_HINT}), or review rollplex_trl/megatron_compat.py "
                          f"against megatron-core {found}.")
    return found


check_megatron_version()

# ------------------------------------------------------------------------------------------------------------------
# CPU shims
# ------------------------------------------------------------------------------------------------------------------

# Modules whose code calls torch.cuda.current_device() on the backend's path (a CPU-only torch raises "Found no
# NVIDIA driver"): MultimodalRotaryEmbedding.__init__ and RotaryEmbedding.get_emb (inv_freq placement), the global
# memory buffer behind the attention scores (GlobalMemoryBuffer.get_tensor), the tensor-parallel all-gathers'
# output buffers (mappings._gather_along_*; used when there are fewer KV groups than TP ranks).
CURRENT_DEVICE_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.mappings",
)
# Autograd functions megatron decorates with torch.amp.custom_fwd/custom_bwd(device_type="cuda"): under CPU autocast
# (TRL's bf16=True on CPU) their backward would run without autocast and fail on a bf16 grad_output times an fp32
# weight ("expected m1 and m2 to have the same dtype"). Re-decorated for "cpu", as they are for "cuda" on a GPU.
AUTOCAST_FUNCTIONS = (
    ("megatron.core.tensor_parallel.layers", "LinearWithGradAccumulationAndAsyncCommunication"),
    ("megatron.core.tensor_parallel.layers", "LinearWithFrozenWeight"),
)
_CPU = torch.device("cpu")


class _CpuCuda:
    """``torch.cuda`` as seen from a shimmed megatron module: the current device is the CPU."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return _CPU


class _TorchOnCpu(types.ModuleType):
    """``torch`` as seen from a shimmed megatron module: identical except ``torch.cuda.current_device()``."""

    cuda = _CpuCuda()

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)


def needs_cpu_shims() -> bool:
    return not torch.cuda.is_available()


def _shim_current_device() -> None:
    # Module-scoped: the module's global name `torch` becomes a proxy, so only megatron's own calls see the CPU.
    for name in CURRENT_DEVICE_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _TorchOnCpu):
            module.torch = _TorchOnCpu()


def _shim_rng_tracker() -> None:
    # DotProductAttention wraps attention dropout in get_cuda_rng_tracker().fork(), whose states come from
    # torch.cuda.get_rng_state(). Megatron's own inference tracker forks into a null context: exact with the
    # backend's dropout 0 (MegatronPolicy always builds GPTModel so); nonzero dropout would draw from the CPU
    # generator, the same stream on every TP rank.
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if tracker is None or type(tracker).__name__ != "InferenceCudaRNGStatesTracker":
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _shim_causal_mask() -> None:
    # With attention_mask=None, FusedScaleMaskSoftmax builds its causal mask with device="cuda" (transformer/utils.py
    # get_default_causal_mask). MegatronPolicy always passes an explicit mask; this covers a bare GPTModel call.
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = _cpu_causal_mask


def _shim_autocast() -> None:
    for module_name, cls_name in AUTOCAST_FUNCTIONS:
        cls = getattr(importlib.import_module(module_name), cls_name)
        if getattr(cls, "_rollplex_cpu_autocast", False):
            continue
        forward, backward = cls.forward.__wrapped__, cls.backward.__wrapped__  # undo megatron's "cuda" decoration
        cls.forward = staticmethod(torch.amp.custom_fwd(forward, device_type="cpu"))
        cls.backward = staticmethod(torch.amp.custom_bwd(backward, device_type="cpu"))
        cls._rollplex_cpu_autocast = True


SHIMS = {
    "current_device": _shim_current_device,
    "rng_tracker": _shim_rng_tracker,
    "causal_mask": _shim_causal_mask,
    "autocast": _shim_autocast,
}


def apply_cpu_shims() -> list[str]:
    """Apply every CPU shim when CUDA is unavailable; returns the names applied (none on a GPU machine).

    Safe to call any number of times; call it before building megatron-core models (constructors allocate).
    """
    if not needs_cpu_shims():
        return []
    for shim in SHIMS.values():
        shim()
    return list(SHIMS)


# ------------------------------------------------------------------------------------------------------------------
# Tensor-parallel all-reduce routing
# ------------------------------------------------------------------------------------------------------------------

# Modules whose TP sums call torch.distributed.all_reduce: mappings._reduce (row-parallel outputs, the vocab-parallel
# embedding, copy_to_tensor_model_parallel_region's backward) and layers (the column-parallel linears' backward
# all-reduces its input gradient itself, async: LinearWithGradAccumulationAndAsyncCommunication, and
# LinearWithFrozenWeight).
ALL_REDUCE_MODULES = ("megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.layers")

# (group, all_reduce) pairs taken by _RoutedDistributed.all_reduce; every other call goes to torch.distributed
_ROUTES: list[tuple[object, Callable[[torch.Tensor], torch.Tensor]]] = []


class _DoneWork:
    """The handle of an all-reduce that already finished (megatron waits on the async one's handle)."""

    @staticmethod
    def wait(*args, **kwargs) -> bool:
        return True

    @staticmethod
    def is_completed() -> bool:
        return True


class _RoutedDistributed(types.ModuleType):
    """``torch.distributed`` as seen from megatron's TP modules: a SUM all-reduce over a routed group (a contiguous
    CPU tensor) goes to its route, synchronously; everything else is torch.distributed's."""

    def __init__(self):
        super().__init__("torch.distributed")

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_reduce(tensor, op=None, group=None, async_op=False):
        sum_op = op is None or op == torch.distributed.ReduceOp.SUM
        if sum_op and tensor.device.type == "cpu" and tensor.is_contiguous():
            for routed, all_reduce in _ROUTES:
                if routed is group:
                    all_reduce(tensor)
                    return _DoneWork() if async_op else None
        kwargs = {} if op is None else {"op": op}
        return torch.distributed.all_reduce(tensor, group=group, async_op=async_op, **kwargs)


class _TorchProxy(types.ModuleType):
    """``torch`` with one attribute overridden (set on the instance); every other name is torch's."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)


_ROUTED = _RoutedDistributed()


def route_tensor_parallel_all_reduce(group, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
    """Send megatron-core's tensor-parallel SUM all-reduces over ``group`` through ``all_reduce`` (in place, returns
    its argument); returns the function that undoes it.

    Module-scoped, as the CPU shims: the global name ``torch`` of the modules in :data:`ALL_REDUCE_MODULES` is (or
    already was, on CPU: :class:`_TorchOnCpu`) a proxy whose ``distributed`` is :class:`_RoutedDistributed`, so
    only megatron's TP code sees the route, and it computes exactly what it did: the same tensors summed at the
    same places (an async all-reduce returns a finished handle)."""
    for name in ALL_REDUCE_MODULES:
        module = importlib.import_module(name)
        if module.torch is torch:  # not shimmed for the CPU (a GPU machine): a proxy of its own
            module.torch = _TorchProxy()
        module.torch.distributed = _ROUTED
    route = (group, all_reduce)
    _ROUTES.append(route)

    def undo() -> None:
        if route in _ROUTES:
            _ROUTES.remove(route)
        if _ROUTES:
            return
        for name in ALL_REDUCE_MODULES:
            module = importlib.import_module(name)
            module.torch.__dict__.pop("distributed", None)
            if isinstance(module.torch, _TorchProxy):
                module.torch = torch

    return undo


# ------------------------------------------------------------------------------------------------------------------
# The core attention the prefix pass subclasses
# ------------------------------------------------------------------------------------------------------------------

# Why: PrefixCoreAttention (backends/megatron/prefix.py) subclasses DotProductAttention (a K/V hook, and one SDPA
# call where it applies) and reads the instance attributes below, which DotProductAttention.__init__ sets; megatron
# documents none of them. tests/megatron/test_megatron_compat.py checks each one against the installed sources.
CORE_ATTENTION_ATTRIBUTES = ("attention_dropout", "softmax_offset", "scale_mask_softmax", "softmax_scale",
                             "hidden_size_per_partition")
CORE_ATTENTION_SOFTMAX_ATTRIBUTES = ("window_size",)  # read on `scale_mask_softmax` (FusedScaleMaskSoftmax)
CORE_ATTENTION_FORWARD = ("query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias",
                          "packed_seq_params")  # the forward parameters the subclass takes and passes on


def core_attention_base() -> type:
    """megatron-core's ``DotProductAttention`` (imported here, not at this module's import: megatron-core loads
    only when the backend builds a model)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention

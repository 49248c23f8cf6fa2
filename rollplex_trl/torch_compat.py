"""The one module that touches torch's private names (as rollplex_trl/trl_compat.py is for TRL and transformers):
a torch upgrade is a review of this file plus tests/test_torch_compat.py, which fails where a name below is gone or
behaves differently; tests/test_compat_boundary.py fails where another module uses a torch private.

What lives here, each with why:
- the supported version range (checked at import);
- :func:`storage_key`: the identity of a storage's StorageImpl (`UntypedStorage._cdata`). Views of one tensor and
  every `untyped_storage()` object of it share it; torch has no public equivalent (`data_ptr()` is 0 for empty
  storages and changes when a storage is resized or swapped, which is what the memory residency code does);
- :func:`tensor_version`: a tensor's in-place version counter (`Tensor._version`), bumped by every in-place write
  (optimizers included): the cheap "did this change" test of the overlap executor and the saved-tensor cache;
- :func:`foreach_copy_` / :func:`foreach_add_`: torch's multi-tensor kernels (`torch._foreach_*`, what the
  optimizers use), one launch per bucket of tensors in the vLLM weight sync;
- :data:`cpu_flash_attention` / :data:`cpu_flash_attention_backward`: PyTorch's fused CPU attention kernels, which
  also return the log-sum-exp the cascade attention merges on (prefix/cascade.py); `F.scaled_dot_product_attention`
  returns no log-sum-exp.
"""

from __future__ import annotations

import torch
from packaging.version import Version

SUPPORTED_TORCH = ("2.9", "3")  # [min, max): pyproject's torch>=2.9; the vLLM tier runs 2.13, the main env 2.14


def check_torch_version(found: str = torch.__version__) -> None:
    """Refuse a torch outside the range whose private names below were checked."""
    low, high = SUPPORTED_TORCH
    if not Version(low) <= Version(Version(found).base_version) < Version(high):
        raise ImportError(f"rollplex_trl supports torch >={low},<{high}; found {found}. Install a supported version, "
                          f"or review rollplex_trl/torch_compat.py against torch {found}.")


check_torch_version()


def storage_key(storage: torch.UntypedStorage) -> int:
    """An int that identifies the StorageImpl behind `storage` (equal for every view of one tensor's memory)."""
    return storage._cdata


def tensor_storage_key(tensor: torch.Tensor) -> int:
    """`storage_key` of the storage `tensor` views."""
    return tensor.untyped_storage()._cdata


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter: it changes whenever the tensor (or a view of it) is written in place."""
    return tensor._version


def foreach_copy_(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """`dst.copy_(src)` for each pair (dtype conversion included), as one multi-tensor kernel launch."""
    torch._foreach_copy_(dsts, srcs)


def foreach_add_(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """`dst.add_(src)` for each pair, as one multi-tensor kernel launch."""
    torch._foreach_add_(dsts, srcs)


# (query, key, value, dropout_p, is_causal, *, attn_mask=None, scale=None) -> (out, logsumexp); out is
# (B, H, Q, D) and logsumexp (B, H, Q) in fp32
cpu_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None)
#   -> (grad_query, grad_key, grad_value)
cpu_flash_attention_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

"""Using a view-class weight without materializing it: a blocked GEMM over its extra dimensions.

A view-class rollout weight ``W`` (logically ``[out, in]``) is an N-D strided tensor whose leading ``row_dims``
dimensions index output features and the rest input features, e.g. a row-parallel shard over two Megatron shards is
``[out, 2, in/2]`` (split-K: two GEMMs summed) and a ``[gate; up]`` shard over two Megatron shards is
``[2, 2, ffn/t, hidden]`` (four GEMMs concatenated). Every block ``W[i..., :, j..., :]`` is a plain 2-D strided matrix
with unit last stride, which BLAS (``lda``) and cuBLAS take as is; ``F.linear(x, W.reshape(out, in))`` would copy.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F


def view_linear(x: torch.Tensor, weight: torch.Tensor, row_dims: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W.reshape(out, in), bias)`` computed block by block from the strided view ``weight``."""
    if row_dims == 0:
        raise ValueError("a 1-D (bias or norm) view has no GEMM; read it with .reshape(-1)")
    rows, cols = weight.shape[:row_dims], weight.shape[row_dims:]
    xs = x.reshape(*x.shape[:-1], *cols)
    outs = []
    for r in itertools.product(*(range(n) for n in rows[:-1])):
        acc = None
        for c in itertools.product(*(range(n) for n in cols[:-1])):
            block = weight[(*r, slice(None), *c, slice(None))]
            part = F.linear(xs[(..., *c, slice(None))], block)
            acc = part if acc is None else acc + part
        outs.append(acc)
    y = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
    assert y.shape[-1] == math.prod(rows)
    return y if bias is None else y + bias.to(y.dtype)  # under autocast y is bf16, as F.linear's would be

"""Materializing a layout from full HF weights: the per-rank content of any framework parameter.

Used to load HF weights into Megatron-Core's parallel layers (the training side) and, in tests, to cross-check the
algebra against independent reference slicing. Weights are only ever indexed with the algebra's maps.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from rollplex_trl.sharding.models import ModelSpec, ParamGroup
from rollplex_trl.sharding.plan import LayoutMaps, ShardingOptions, rollout_specs, train_specs


def stacked_sources(group: ParamGroup, hf: Mapping[str, torch.Tensor], extra_rows: int = 0) -> torch.Tensor:
    """V: the group's sources flattened to 2-D and stacked along dim 0, plus ``extra_rows`` zero (padding) rows."""
    parts = []
    for source, name in zip(group.kind.sources, group.hf_names):
        w = hf[name]
        index, count = source.part
        rows = w.shape[0] // count
        parts.append(w[index * rows:(index + 1) * rows].reshape(rows, -1))
    v = torch.cat(parts)
    if extra_rows:
        v = torch.cat([v, v.new_zeros(extra_rows, v.shape[1])])
    return v


def shard_tensor(group: ParamGroup, rows: np.ndarray, cols: np.ndarray, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
    v = stacked_sources(group, hf, max(0, int(rows.max()) + 1 - sum(r for r, _ in group.shapes)))
    out = v[torch.as_tensor(rows)][:, torch.as_tensor(cols)]
    return out.reshape(-1) if group.one_dim else out


def framework_state(model: ModelSpec, options: ShardingOptions, side: str, rank: int,
                    hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every parameter of one rank of one side ("train": Megatron-Core, "rollout": vLLM), by framework name."""
    maps = LayoutMaps(options)
    out = {}
    for g in model.groups:
        specs = train_specs(g, options) if side == "train" else rollout_specs(g, options)
        for si, (_spec, name) in enumerate(specs):
            rows, cols = maps.get(g, side, si, rank)
            out[name] = shard_tensor(g, rows, cols, hf)
    return out

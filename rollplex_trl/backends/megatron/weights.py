"""HF <-> Megatron-Core weights of the LLM, both ways through the layout algebra (rollplex_trl.sharding).

Loading: ``framework_state(..., side="train")`` gives every Megatron parameter of one TP rank from the HF tensors.
Saving: the same index maps inverted, ``V[rows[:, None], cols] = local`` for the shard of every rank (all-gathered
over the TP group, bucket by bucket), then V cut back into its HF sources. Nothing here slices weights by hand.

Names: ``model_spec_from_config`` names Qwen2.5-VL's LLM parameters ``language_model.<GPTModel name>`` and Qwen2's
``<GPTModel name>``; HF names are the HF model's own (transformers 5: ``model.language_model.*``, ``model.visual.*``,
``lm_head.weight`` for Qwen2.5-VL; ``model.*``, ``lm_head.weight`` for Qwen2). A tied LM head is absent on both
sides (HF's ``named_parameters`` skips it; GPTModel shares its embedding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist

from rollplex_trl.sharding import ShardingOptions
from rollplex_trl.sharding.materialize import framework_state
from rollplex_trl.sharding.models import ModelSpec, model_spec_from_config
from rollplex_trl.sharding.plan import LayoutMaps, train_specs

VL_PREFIX = "language_model."
BUCKET_BYTES = 256 << 20  # local bytes per all-gather when unsharding


def sharding_options(tensor_parallel_size: int) -> ShardingOptions:
    """The backend's layout: Megatron-Bridge's convention (HF vision tower replicated, no vocabulary padding)."""
    return ShardingOptions(train_tp=tensor_parallel_size, rollout_tp=1, megatron_vision="replicated",
                           megatron_vocab_multiple=0)


def llm_spec(config) -> ModelSpec:
    """The HF model's LLM parameter groups (the vision tower stays an HF module, trained in place)."""
    spec = model_spec_from_config(config)
    return dataclasses.replace(spec, groups=[g for g in spec.groups if g.kind.tower == "llm"])


def gpt_name(framework_name: str, is_vl: bool) -> str:
    return framework_name.removeprefix(VL_PREFIX) if is_vl else framework_name


def megatron_state(spec: ModelSpec, options: ShardingOptions, rank: int,
                   hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s GPTModel parameters (GPTModel names) built from the HF tensors ``hf``."""
    return {gpt_name(n, spec.is_vl): t for n, t in framework_state(spec, options, "train", rank, hf).items()}


def _gather_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup, size: int) -> list[torch.Tensor]:
    """All-gather a list of same-dtype tensors with one collective: per rank, the flat concatenation."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.empty(0)
    if size == 1:
        return [flat]
    parts = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(parts, flat.contiguous(), group=group)
    return parts


def iter_hf_llm_state(spec: ModelSpec, options: ShardingOptions, params: Mapping[str, torch.Tensor],
                      group: dist.ProcessGroup, shapes: Mapping[str, torch.Size],
                      bucket_bytes: int = BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """The full HF tensors of the LLM, ``(hf name, tensor)``, from this rank's GPTModel parameters ``params``
    (GPTModel names), all-gathered over the TP group ``group`` one bucket of about ``bucket_bytes`` (local bytes)
    at a time; identical on every rank (every rank must consume it: it runs collectives). ``shapes``: HF shapes."""
    maps, t = LayoutMaps(options), options.train_tp
    entries = [(g, si, gpt_name(name, spec.is_vl), shard.split is not None)
               for g in spec.groups for si, (shard, name) in enumerate(train_specs(g, options))]
    start = 0
    while start < len(entries):
        end, size = start, 0
        while end < len(entries) and (end == start or size < bucket_bytes):
            size += params[entries[end][2]].numel() * params[entries[end][2]].element_size()
            end += 1
        yield from _unshard_bucket(entries[start:end], maps, t, params, group, shapes)
        start = end


def _unshard_bucket(entries, maps: LayoutMaps, t: int, params, group, shapes) -> Iterator[tuple[str, torch.Tensor]]:
    split = [name for _, _, name, is_split in entries if is_split]
    gathered = _gather_flat([params[name] for name in split], group, t)
    offsets, offset = {}, 0
    for name in split:
        offsets[name] = offset
        offset += params[name].numel()
    for g, si, name, is_split in entries:
        local = params[name].detach()
        n_real = sum(r for r, _ in g.shapes)
        v = local.new_empty(n_real, g.num_cols)
        ranks = [maps.get(g, "train", si, k) for k in range(t if is_split else 1)]
        _check_covered(name, ranks, n_real, g.num_cols)
        for k, (rows, cols) in enumerate(ranks):
            part = local if not is_split else gathered[k][offsets[name]:offsets[name] + local.numel()]
            part = part.reshape(len(rows), len(cols))
            real = rows < n_real  # vocabulary padding rows have no HF row
            r = torch.as_tensor(rows[real], device=v.device)
            v[r[:, None], torch.as_tensor(cols, device=v.device)] = part[torch.as_tensor(real, device=v.device)]
        for hf_name, source in zip(g.hf_names, g.source_rows):
            yield hf_name, v[torch.as_tensor(source, device=v.device)].reshape(shapes[hf_name])


def _check_covered(name: str, ranks: list[tuple[np.ndarray, np.ndarray]], n_real: int, num_cols: int) -> None:
    """Every HF element is written by some rank (each rank's map is rows x cols, with either the rows or the
    columns the same on every rank)."""
    rows = np.unique(np.concatenate([r for r, _ in ranks]))
    cols = np.unique(np.concatenate([c for _, c in ranks]))
    same_rows = all(np.array_equal(ranks[0][0], r) for r, _ in ranks)
    same_cols = all(np.array_equal(ranks[0][1], c) for _, c in ranks)
    if not ((same_rows or same_cols) and np.isin(np.arange(n_real), rows).all()
            and np.array_equal(cols, np.arange(num_cols))):
        raise RuntimeError(f"{name}: the layout maps do not cover every HF element (layout algebra bug)")


def duplicate_rows(spec: ModelSpec, options: ShardingOptions, rank: int) -> dict[str, np.ndarray]:
    """Rows of this rank's split parameters that a lower TP rank holds too (GPTModel names; only parameters with
    any). With fewer KV groups than ranks, Megatron's fused QKV replicates each group's k/v rows on several ranks:
    a global gradient norm must count them once."""
    maps, out = LayoutMaps(options), {}
    for g in spec.groups:
        for si, (shard, name) in enumerate(train_specs(g, options)):
            if shard.split != 0 or rank == 0:
                continue  # only a row split can repeat rows (a column split holds disjoint columns of all rows)
            seen = np.concatenate([maps.get(g, "train", si, k)[0] for k in range(rank)])
            dup = np.isin(maps.get(g, "train", si, rank)[0], seen)
            if dup.any():
                out[gpt_name(name, spec.is_vl)] = dup
    return out

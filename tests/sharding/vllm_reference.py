"""Independent reference: what vLLM's weight loaders put in each rank's parameters of Qwen2.5-VL.

Written from vLLM's loader code (``QKVParallelLinear`` / ``MergedColumnParallelLinear`` / ``RowParallelLinear`` /
``VocabParallelEmbedding.weight_loader``: ``narrow`` + ``copy_`` into a freshly allocated parameter), without any of
rollplex_trl's layout code, so that it can check the layout algebra.
"""

from __future__ import annotations

import re

import torch


def _pad_vocab(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int, tp: int,
         rank: int) -> torch.Tensor:
    head_dim = q.shape[0] // heads
    if tp >= kv_heads:
        n_kv, replicas = 1, tp // kv_heads
    else:
        n_kv, replicas = kv_heads // tp, 1
    n_q = heads // tp
    param = q.new_empty((n_q + 2 * n_kv) * head_dim, *q.shape[1:])
    for loaded, offset, size, index in (
            (q, 0, n_q * head_dim, rank),  # loaded_shard_id "q"
            (k, n_q * head_dim, n_kv * head_dim, rank // replicas),  # "k": tp_rank // num_kv_head_replicas
            (v, (n_q + n_kv) * head_dim, n_kv * head_dim, rank // replicas)):  # "v"
        param.narrow(0, offset, size).copy_(loaded.narrow(0, index * size, size))
    return param


def _merged(parts: list[torch.Tensor], tp: int, rank: int) -> torch.Tensor:
    sizes = [p.shape[0] // tp for p in parts]
    param = parts[0].new_empty(sum(sizes), *parts[0].shape[1:])
    offset = 0
    for loaded, size in zip(parts, sizes):
        param.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))
        offset += size
    return param


def _row(w: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    size = w.shape[1] // tp
    return w.narrow(1, rank * size, size).clone()


def _col(w: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    size = w.shape[0] // tp
    return w.narrow(0, rank * size, size).clone()


def _vocab(w: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    per = _pad_vocab(w.shape[0]) // tp
    param = w.new_empty(per, w.shape[1])
    start, end = rank * per, min((rank + 1) * per, w.shape[0])
    loaded = w.narrow(0, start, max(0, end - start))
    param[:loaded.shape[0]].copy_(loaded)
    param[loaded.shape[0]:].fill_(0)
    return param


def vllm_rank_weights(hf: dict[str, torch.Tensor], config, tp: int, rank: int,
                      vision_tp: bool = True) -> dict[str, torch.Tensor]:
    """vLLM parameter name -> tensor for rollout rank ``rank`` of ``tp`` (vision tower sharded unless not)."""
    text, vision = config.text_config, config.vision_config
    out: dict[str, torch.Tensor] = {}
    for name, w in hf.items():
        llm = re.fullmatch(r"model\.language_model\.(.*)", name)
        vit = re.fullmatch(r"model\.visual\.(.*)", name)
        if name == "lm_head.weight":
            out["language_model.lm_head.weight"] = _vocab(w, tp, rank)
        elif llm:
            rest, prefix = llm.group(1), "language_model.model."
            layer = re.fullmatch(r"(layers\.\d+\.)self_attn\.q_proj\.(weight|bias)", rest)
            if layer:
                base, kind = layer.group(1), layer.group(2)
                get = lambda x, b=base, k=kind: hf[f"model.language_model.{b}self_attn.{x}_proj.{k}"]  # noqa: E731
                out[f"{prefix}{base}self_attn.qkv_proj.{kind}"] = _qkv(
                    get("q"), get("k"), get("v"), text.num_attention_heads, text.num_key_value_heads, tp, rank)
            elif re.search(r"self_attn\.[kv]_proj", rest):
                continue
            elif rest.endswith("self_attn.o_proj.weight") or rest.endswith("mlp.down_proj.weight"):
                out[prefix + rest] = _row(w, tp, rank)
            elif rest.endswith("mlp.gate_proj.weight"):
                up = hf[name.replace("gate_proj", "up_proj")]
                out[prefix + rest.replace("gate_proj", "gate_up_proj")] = _merged([w, up], tp, rank)
            elif rest.endswith("mlp.up_proj.weight"):
                continue
            elif rest == "embed_tokens.weight":
                out[prefix + rest] = _vocab(w, tp, rank)
            else:  # norms: replicated
                out[prefix + rest] = w.clone()
        elif vit:
            rest, prefix = vit.group(1), "visual."
            vtp, vrank = (tp, rank) if vision_tp else (1, 0)
            if rest.endswith("attn.qkv.weight") or rest.endswith("attn.qkv.bias"):
                q, k, v = w.chunk(3, dim=0)  # vLLM splits the fused HF tensor, then loads each shard
                out[prefix + rest] = _qkv(q, k, v, vision.num_heads, vision.num_heads, vtp, vrank)
            elif rest.endswith("gate_proj.weight") or rest.endswith("gate_proj.bias"):
                up = hf[name.replace("gate_proj", "up_proj")]
                out[prefix + rest.replace("gate_proj", "gate_up_proj")] = _merged([w, up], vtp, vrank)
            elif "up_proj" in rest:
                continue
            elif rest.endswith(("attn.proj.weight", "mlp.down_proj.weight", "merger.mlp.2.weight")):
                out[prefix + rest] = _row(w, vtp, vrank)
            elif rest.endswith(("merger.mlp.0.weight", "merger.mlp.0.bias")):
                out[prefix + rest] = _col(w, vtp, vrank)
            elif rest == "patch_embed.proj.weight":
                out[prefix + rest] = w.reshape(w.shape[0], -1).clone()  # conv3d_to_linear_weight
            else:  # norms and row-parallel biases: replicated
                out[prefix + rest] = w.clone()
        else:
            raise KeyError(f"reference has no rule for {name}")
    return out

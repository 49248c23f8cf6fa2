"""The layout algebra against independent reference slicing (vLLM's loaders, Megatron-Bridge's mappings)."""

import pytest
import torch
from dist_worker import hf_weights, tiny_config
from vllm_reference import vllm_rank_weights

from rollplex_trl.sharding import LayoutError, ShardingOptions, model_spec_from_config
from rollplex_trl.sharding.layouts import VocabPadding
from rollplex_trl.sharding.materialize import framework_state
from rollplex_trl.sharding.models import groups_from_shapes


@pytest.fixture(scope="module")
def tiny():
    config = tiny_config()
    return config, model_spec_from_config(config, "tiny"), hf_weights(config)


def megatron_reference(hf, config, t, k, vision_sharded, vocab_multiple):
    """Megatron-Bridge style: merge_qkv_weights (per-group [q; k; v]), GatedMLPMapping ([gate_k; up_k]), column /
    row splits, vocab padded to a multiple of (multiple * t) with zero rows; replicated tensors as they are."""
    text, vis = config.text_config, config.vision_config

    def merge_qkv(q, k_, v, nq, ng):
        hd = q.shape[0] // nq
        tail = q.shape[1:]
        q, k_, v = q.view(ng, nq // ng, hd, *tail), k_.view(ng, 1, hd, *tail), v.view(ng, 1, hd, *tail)
        return torch.cat([q, k_, v], dim=1).reshape(-1, *tail)

    def col(w):
        return w.chunk(t, dim=0)[k]

    out = {}
    lm, vm = "language_model.", "vision_model."
    vocab = text.vocab_size if not vocab_multiple else -(-text.vocab_size // (vocab_multiple * t)) * vocab_multiple * t
    for name in ("embed_tokens", "lm_head"):
        w = hf["model.language_model.embed_tokens.weight" if name == "embed_tokens" else "lm_head.weight"]
        w = torch.cat([w, w.new_zeros(vocab - w.shape[0], w.shape[1])])
        out[lm + ("embedding.word_embeddings.weight" if name == "embed_tokens" else "output_layer.weight")] = col(w)
    out[lm + "decoder.final_layernorm.weight"] = hf["model.language_model.norm.weight"]
    for i in range(text.num_hidden_layers):
        p, m = f"model.language_model.layers.{i}.", f"{lm}decoder.layers.{i}."
        for kind in ("weight", "bias"):
            qkv = merge_qkv(*(hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv"), text.num_attention_heads,
                            text.num_key_value_heads)
            out[f"{m}self_attention.linear_qkv.{kind}"] = col(qkv)
        out[f"{m}self_attention.linear_proj.weight"] = hf[f"{p}self_attn.o_proj.weight"].chunk(t, dim=1)[k]
        out[f"{m}mlp.linear_fc1.weight"] = torch.cat([col(hf[f"{p}mlp.gate_proj.weight"]),
                                                      col(hf[f"{p}mlp.up_proj.weight"])])
        out[f"{m}mlp.linear_fc2.weight"] = hf[f"{p}mlp.down_proj.weight"].chunk(t, dim=1)[k]
        out[f"{m}input_layernorm.weight"] = hf[f"{p}input_layernorm.weight"]
        out[f"{m}pre_mlp_layernorm.weight"] = hf[f"{p}post_attention_layernorm.weight"]
    visual = {n: w for n, w in hf.items() if n.startswith("model.visual.")}
    if not vision_sharded:
        out.update({n.removeprefix("model."): w for n, w in visual.items()})
        return out
    for i in range(vis.depth):
        p, m = f"model.visual.blocks.{i}.", f"{vm}decoder.layers.{i}."
        for kind in ("weight", "bias"):
            q, k_, v = hf[f"{p}attn.qkv.{kind}"].chunk(3)
            out[f"{m}self_attention.linear_qkv.{kind}"] = col(merge_qkv(q, k_, v, vis.num_heads, vis.num_heads))
            out[f"{m}mlp.linear_fc1.{kind}"] = torch.cat([col(hf[f"{p}mlp.gate_proj.{kind}"]),
                                                          col(hf[f"{p}mlp.up_proj.{kind}"])])
        out[f"{m}self_attention.linear_proj.weight"] = hf[f"{p}attn.proj.weight"].chunk(t, dim=1)[k]
        out[f"{m}self_attention.linear_proj.bias"] = hf[f"{p}attn.proj.bias"]
        out[f"{m}mlp.linear_fc2.weight"] = hf[f"{p}mlp.down_proj.weight"].chunk(t, dim=1)[k]
        out[f"{m}mlp.linear_fc2.bias"] = hf[f"{p}mlp.down_proj.bias"]
        out[f"{m}input_layernorm.weight"] = hf[f"{p}norm1.weight"]
        out[f"{m}pre_mlp_layernorm.weight"] = hf[f"{p}norm2.weight"]
    out[vm + "patch_embed.proj.weight"] = hf["model.visual.patch_embed.proj.weight"]
    out[vm + "decoder.final_layernorm.weight"] = hf["model.visual.merger.ln_q.weight"]
    out[vm + "projection.encoder.linear_fc1.weight"] = col(hf["model.visual.merger.mlp.0.weight"])
    out[vm + "projection.encoder.linear_fc1.bias"] = col(hf["model.visual.merger.mlp.0.bias"])
    out[vm + "projection.encoder.linear_fc2.weight"] = hf["model.visual.merger.mlp.2.weight"].chunk(t, dim=1)[k]
    out[vm + "projection.encoder.linear_fc2.bias"] = hf["model.visual.merger.mlp.2.bias"]
    return out


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
    for name, w in want.items():
        assert torch.equal(got[name].reshape(w.shape), w), name


@pytest.mark.parametrize("r", [1, 2, 4, 8])
@pytest.mark.parametrize("vision", ["sharded", "replicated"])
def test_vllm_layout_matches_vllm_loaders(tiny, r, vision):
    config, model, hf = tiny
    options = ShardingOptions(train_tp=1, rollout_tp=r, vllm_vision=vision)
    for j in range(r):
        _assert_same(framework_state(model, options, "rollout", j, hf),
                     vllm_rank_weights(hf, config, r, j, vision_tp=vision == "sharded"))


@pytest.mark.parametrize("r", [1, 2, 4, 8])
@pytest.mark.parametrize("vision", ["sharded", "replicated"])
def test_live_sync_slices_match_vllm_loaders(tiny, r, vision):
    """What the live weight sync copies (narrow slices of HF tensors, from the same table) is what vLLM loads."""
    config, model, hf = tiny
    for j in range(r):
        want = vllm_rank_weights(hf, config, r, j, vision_tp=vision == "sharded")
        got = {}
        for g in model.groups:
            tp, rank = (1, 0) if g.kind.tower == "vision" and vision == "replicated" else (r, j)
            for spec in g.kind.vllm:
                name = g.vllm_name(spec)
                shape, pieces = g.rank_layout(spec, tp, rank, name, VocabPadding(64) if spec.vocab else None)
                out = torch.zeros(shape)
                for p in pieces:
                    p.dst_view(out).copy_(p.src_view(hf[p.src_name]))
                got[name] = out
        _assert_same(got, want)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("vision,vocab_multiple", [("sharded", 16), ("replicated", 0)])
def test_megatron_layout_matches_bridge_mappings(tiny, t, vision, vocab_multiple):
    config, model, hf = tiny
    options = ShardingOptions(train_tp=t, rollout_tp=1, megatron_vision=vision, megatron_vocab_multiple=vocab_multiple)
    for k in range(t):
        _assert_same(framework_state(model, options, "train", k, hf),
                     megatron_reference(hf, config, t, k, vision == "sharded", vocab_multiple))


def test_impossible_splits_name_the_tensor(tiny):
    _, model, hf = tiny
    with pytest.raises(LayoutError, match=r"Megatron language_model\.decoder\.layers\.0\..*linear_qkv.*8 query"):
        framework_state(model, ShardingOptions(train_tp=16, rollout_tp=1, megatron_vocab_multiple=16), "train", 0, hf)
    with pytest.raises(LayoutError, match=r"vLLM visual\.blocks\.0\.attn\.qkv\.weight: 8 heads"):
        framework_state(model, ShardingOptions(train_tp=1, rollout_tp=3), "rollout", 0, hf)
    with pytest.raises(LayoutError, match=r"vLLM language_model\.model\.embed_tokens\.weight: 1024 rows"):
        framework_state(model, ShardingOptions(train_tp=1, rollout_tp=3, vllm_vision="replicated"), "rollout", 0, hf)


def test_unknown_parameters_are_an_error():
    with pytest.raises(LayoutError, match="no sharding layout"):
        groups_from_shapes({"model.layers.0.self_attn.rotary.weight": (4, 4)}, {"llm": 4}, is_vl=False)


def test_text_only_qwen2_is_planned_too():
    from transformers import Qwen2Config

    from rollplex_trl.sharding import plan_sharding

    config = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=1024, tie_word_embeddings=True)
    model = model_spec_from_config(config, "tiny-qwen2")
    assert not any(g.kind.tower == "vision" for g in model.groups)
    assert not any(g.kind.key == "llm.lm_head" for g in model.groups)  # tied: vLLM ties it too
    summary = plan_sharding(model, ShardingOptions(train_tp=4, rollout_tp=2, page_size=4096)).summary()
    assert abs(sum(summary["by_params"].values()) - 1) < 1e-9
    assert summary["by_kind"]["llm.embed"]["aligned"] == 1.0

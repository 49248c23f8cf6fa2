"""Layout rules and alias views with plain tensors and fake vLLM modules (no vLLM needed).

The fake modules carry the attributes vLLM's layers expose (tp_rank, head sizes, output sizes, partition sizes,
shard indices), and the expected vLLM shards are written out by hand from vLLM's weight_loader rules.
"""

from types import SimpleNamespace

import pytest
import torch

from rollplex_trl.rollout.layout import (
    Piece,
    Target,
    check_tiling,
    describe_pieces,
    group_into_buckets,
    install_alias,
    is_alias_of,
)


class QKVParallelLinear:  # the class name is what the rules look at
    def __init__(self, tp_rank, tp_size, heads=8, kv_heads=2, head_size=4):
        self.tp_rank, self.tp_size, self.head_size = tp_rank, tp_size, head_size
        self.num_heads = heads // tp_size
        self.num_kv_heads = max(1, kv_heads // tp_size)
        self.num_kv_head_replicas = max(1, tp_size // kv_heads)


class MergedColumnParallelLinear:
    def __init__(self, tp_rank, tp_size, sizes=(12, 12)):
        self.tp_rank, self.tp_size, self.output_sizes = tp_rank, tp_size, list(sizes)


class RowParallelLinear:
    def __init__(self, tp_rank, tp_size, in_features=12):
        self.tp_rank, self.input_size_per_partition = tp_rank, in_features // tp_size


class VocabParallelEmbedding:
    def __init__(self, start, end):
        self.shard_indices = SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=end)


def _fill(target: Target, sources: dict[str, torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(target.shape)
    check_tiling(target, {k: v.shape for k, v in sources.items()})
    for p in target.pieces:
        p.dst_view(out).copy_(p.src_view(sources[p.src_name]))
    return out


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_rank_shards_follow_vllm(tp_size):
    hs, heads, kv = 4, 8, 2
    q, k, v = torch.randn(heads * hs, 16), torch.randn(kv * hs, 16), torch.randn(kv * hs, 16)
    for rank in range(tp_size):
        m = QKVParallelLinear(rank, tp_size, heads, kv, hs)
        rows = (m.num_heads + 2 * m.num_kv_heads) * hs
        t = Target("qkv_proj.weight", "qkv_proj", "weight", (rows, 16), torch.float32)
        for name, shard in (("q", "q"), ("k", "k"), ("v", "v")):
            t.pieces += describe_pieces(m, name, {"q": q, "k": k, "v": v}[name].shape, t.name, "weight", shard)
        got = _fill(t, {"q": q, "k": k, "v": v})
        qs = m.num_heads * hs
        kv_rank = rank // m.num_kv_head_replicas  # KV heads replicated when tp > kv heads
        ks = m.num_kv_heads * hs
        expected = torch.cat([q[rank * qs:(rank + 1) * qs], k[kv_rank * ks:(kv_rank + 1) * ks],
                              v[kv_rank * ks:(kv_rank + 1) * ks]])
        assert torch.equal(got, expected)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_gate_up_and_row_parallel_shards(tp_size):
    gate, up, down = torch.randn(12, 8), torch.randn(12, 8), torch.randn(8, 12)
    for rank in range(tp_size):
        m = MergedColumnParallelLinear(rank, tp_size)
        local = 12 // tp_size
        t = Target("gate_up_proj.weight", "gate_up_proj", "weight", (2 * local, 8), torch.float32)
        t.pieces += describe_pieces(m, "gate", gate.shape, t.name, "weight", 0)
        t.pieces += describe_pieces(m, "up", up.shape, t.name, "weight", 1)
        expected = torch.cat([gate[rank * local:(rank + 1) * local], up[rank * local:(rank + 1) * local]])
        assert torch.equal(_fill(t, {"gate": gate, "up": up}), expected)

        r = RowParallelLinear(rank, tp_size)
        t = Target("down_proj.weight", "down_proj", "weight", (8, local), torch.float32)
        t.pieces += describe_pieces(r, "down", down.shape, t.name, "weight", None)
        assert torch.equal(_fill(t, {"down": down}), down[:, rank * local:(rank + 1) * local])


def test_vocab_rows_and_padding():
    emb = torch.randn(10, 4)  # HF vocabulary of 10; vLLM pads each rank's shard to 8 rows
    t = Target("embed.weight", "embed", "weight", (8, 4), torch.float32)
    t.pieces += describe_pieces(VocabParallelEmbedding(8, 10), "emb", emb.shape, t.name, "weight", None)
    got = _fill(t, {"emb": emb})
    assert torch.equal(got[:2], emb[8:10]) and torch.equal(got[2:], torch.zeros(6, 4))


def test_tiling_mismatch_is_an_error():
    t = Target("x.weight", "x", "weight", (4, 3), torch.float32, pieces=[Piece("a", "x.weight", 0, 0, 0, 4)])
    with pytest.raises(ValueError, match="differ outside"):
        check_tiling(t, {"a": (4, 5)})


def test_buckets_respect_the_byte_budget():
    assert group_into_buckets([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]


def test_alias_views_of_a_fused_buffer_follow_the_optimizer(tiny_qwen2_path):
    """q/k/v and gate/up of a real HF model become row slices of fused 'vLLM' buffers; an optimizer step then
    updates the buffers with no sync, the forward is unchanged, and save/load round-trips."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 20, 33, 40]])
    before = model(ids).logits
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    qkv = torch.empty(q.shape[0] + k.shape[0] + v.shape[0], q.shape[1])
    pieces = [Piece("q", "qkv", 0, 0, 0, q.shape[0]), Piece("k", "qkv", 0, 0, q.shape[0], k.shape[0]),
              Piece("v", "qkv", 0, 0, q.shape[0] + k.shape[0], v.shape[0])]
    for param, piece in zip((q, k, v), pieces, strict=True):
        install_alias(param, qkv, piece)
        assert is_alias_of(param.detach(), qkv, piece) and param.is_contiguous()
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    gate_up = torch.empty(2 * gate.shape[0], gate.shape[1])
    install_alias(gate, gate_up, Piece("g", "gu", 0, 0, 0, gate.shape[0]))
    install_alias(up, gate_up, Piece("u", "gu", 0, 0, gate.shape[0], up.shape[0]))
    assert torch.equal(model(ids).logits, before)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert torch.equal(qkv, torch.cat([q.detach(), k.detach(), v.detach()]))
    assert torch.equal(gate_up, torch.cat([gate.detach(), up.detach()]))
    assert not torch.equal(model(ids).logits, before)


def test_aliased_model_saves_and_loads(tiny_qwen2_path, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    q, k = attn.q_proj.weight, attn.k_proj.weight
    fused = torch.empty(q.shape[0] + k.shape[0], q.shape[1])
    install_alias(q, fused, Piece("q", "f", 0, 0, 0, q.shape[0]))
    install_alias(k, fused, Piece("k", "f", 0, 0, q.shape[0], k.shape[0]))
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name

"""The live sync's layout, derived from the sharding table, with plain tensors and fake vLLM modules (no vLLM).

The expected vLLM shards are written out by hand from vLLM's weight_loader rules (QKVParallelLinear with KV-head
replication, MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding); the fake vLLM model carries only
what a live one gives the sync: parameter names and shapes, `tp_size`/`tp_rank`, `padding_size` and its HF config.
"""

from types import SimpleNamespace

import pytest
import torch

from rollplex_trl.rollout.layout import Target, check_tiling, group_into_buckets, install_alias, is_alias_of
from rollplex_trl.rollout.sources import TrainerTensor
from rollplex_trl.rollout.vllm_targets import VLLMTargets
from rollplex_trl.sharding import LayoutError
from rollplex_trl.sharding.layouts import SlicePair, VocabPadding
from rollplex_trl.sharding.models import match_groups

LAYER = "model.layers.0."


def _target(shapes: dict, tp: int, rank: int, head_dim: int = 4, padding: VocabPadding | None = None) -> Target:
    """The one vLLM target of the HF tensors `shapes` (one parameter kind), for rank `rank` of `tp`."""
    (group,), unclaimed = match_groups(shapes, {"llm": head_dim}, is_vl=False)
    assert not unclaimed
    (spec,) = group.kind.vllm
    name = group.vllm_name(spec)
    shape, pieces = group.rank_layout(spec, tp, rank, name, padding)
    return Target(name, name.rsplit(".", 1)[0], name.rsplit(".", 1)[1], shape, torch.float32, pieces=pieces)


def _fill(target: Target, sources: dict[str, torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(target.shape)
    check_tiling(target, {k: v.shape for k, v in sources.items()})
    for p in target.pieces:
        p.dst_view(out).copy_(p.src_view(sources[p.src_name]))
    return out


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_rank_shards_follow_vllm(tp_size):
    hs, heads, kv = 4, 8, 2
    hf = {f"{LAYER}self_attn.{x}_proj.weight": torch.randn(n * hs, 16) for x, n in (("q", heads), ("k", kv),
                                                                                   ("v", kv))}
    q, k, v = hf.values()
    for rank in range(tp_size):
        t = _target({n: w.shape for n, w in hf.items()}, tp_size, rank, hs)
        assert t.name == f"{LAYER}self_attn.qkv_proj.weight"
        qs = heads // tp_size * hs
        replicas = max(1, tp_size // kv)  # KV heads replicated when tp > kv heads
        ks = max(1, kv // tp_size) * hs
        kv_rank = rank // replicas
        expected = torch.cat([q[rank * qs:(rank + 1) * qs], k[kv_rank * ks:(kv_rank + 1) * ks],
                              v[kv_rank * ks:(kv_rank + 1) * ks]])
        assert torch.equal(_fill(t, hf), expected)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_gate_up_and_row_parallel_shards(tp_size):
    gate_up = {f"{LAYER}mlp.gate_proj.weight": torch.randn(12, 8), f"{LAYER}mlp.up_proj.weight": torch.randn(12, 8)}
    down = {f"{LAYER}mlp.down_proj.weight": torch.randn(8, 12)}
    gate, up = gate_up.values()
    (d,) = down.values()
    for rank in range(tp_size):
        local = 12 // tp_size
        t = _target({n: w.shape for n, w in gate_up.items()}, tp_size, rank)
        expected = torch.cat([gate[rank * local:(rank + 1) * local], up[rank * local:(rank + 1) * local]])
        assert t.name.endswith("mlp.gate_up_proj.weight") and torch.equal(_fill(t, gate_up), expected)
        t = _target({n: w.shape for n, w in down.items()}, tp_size, rank)
        # row-parallel: a column block of the HF tensor (at TP = 1 the whole tensor, a plain row block)
        assert [p.dim for p in t.pieces] == [1 if tp_size > 1 else 0]
        assert torch.equal(_fill(t, down), d[:, rank * local:(rank + 1) * local])


def test_vocab_rows_and_padding():
    emb = {"model.embed_tokens.weight": torch.randn(10, 4)}  # vocabulary of 10, padded to 16, 8 rows per rank
    t = _target({n: w.shape for n, w in emb.items()}, 2, 1, padding=VocabPadding(8))
    got = _fill(t, emb)
    assert got.shape == (8, 4)
    assert torch.equal(got[:2], emb["model.embed_tokens.weight"][8:10]) and torch.equal(got[2:], torch.zeros(6, 4))


def test_tiling_mismatch_is_an_error():
    t = Target("x.weight", "x", "weight", (4, 3), torch.float32, pieces=[SlicePair("a", "x.weight", 0, 0, 0, 4)])
    with pytest.raises(ValueError, match="differ outside"):
        check_tiling(t, {"a": (4, 5)})


def test_buckets_respect_the_byte_budget():
    assert group_into_buckets([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]


# ------------------------------------------------------------------------------------ a fake live vLLM model
class _Layer(torch.nn.Module):
    def __init__(self, shape, tp=None, rank=None, **attrs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
        if tp is not None:
            self.tp_size, self.tp_rank = tp, rank
        for k, v in attrs.items():
            setattr(self, k, v)


def _fake_vllm(tp, rank, vocab=10, hidden=8, heads=4, kv=2, hd=2, ffn=12, tie=False, qkv_rows=None):
    """vLLM's Qwen2ForCausalLM as the sync sees it: one decoder layer (no biases), rank `rank` of `tp`."""
    root = torch.nn.Module()
    root.config = SimpleNamespace(hidden_size=hidden, num_attention_heads=heads, head_dim=hd,
                                  tie_word_embeddings=tie)
    per_vocab = -(-vocab // 8) * 8 // tp
    model, layer = torch.nn.Module(), torch.nn.Module()
    model.embed_tokens = _Layer((per_vocab, hidden), tp, rank, padding_size=8)
    model.norm = _Layer((hidden,))
    attn, mlp = torch.nn.Module(), torch.nn.Module()
    qkv_rows = qkv_rows or (heads // tp + 2 * max(1, kv // tp)) * hd
    attn.qkv_proj, attn.o_proj = _Layer((qkv_rows, hidden), tp, rank), _Layer((hidden, heads * hd // tp), tp, rank)
    mlp.gate_up_proj, mlp.down_proj = _Layer((2 * ffn // tp, hidden), tp, rank), _Layer((hidden, ffn // tp), tp, rank)
    layer.self_attn, layer.mlp = attn, mlp
    layer.input_layernorm, layer.post_attention_layernorm = _Layer((hidden,)), _Layer((hidden,))
    model.layers = torch.nn.ModuleList([layer])
    root.model = model
    root.lm_head = model.embed_tokens if tie else _Layer((per_vocab, hidden), tp, rank, padding_size=8)
    return root


def _hf(vocab=10, hidden=8, heads=4, kv=2, hd=2, ffn=12, tie=False):
    torch.manual_seed(0)
    layer = {"self_attn.q_proj.weight": (heads * hd, hidden), "self_attn.k_proj.weight": (kv * hd, hidden),
             "self_attn.v_proj.weight": (kv * hd, hidden), "self_attn.o_proj.weight": (hidden, heads * hd),
             "mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
             "mlp.down_proj.weight": (hidden, ffn), "input_layernorm.weight": (hidden,),
             "post_attention_layernorm.weight": (hidden,)}
    shapes = {"model.embed_tokens.weight": (vocab, hidden), **{LAYER + n: s for n, s in layer.items()},
              "model.norm.weight": (hidden,)}
    if not tie:
        shapes["lm_head.weight"] = (vocab, hidden)
    return {n: torch.nn.Parameter(torch.randn(s)) for n, s in shapes.items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_live_targets_come_from_the_table(tp):
    """Names, shapes and slices of every vLLM parameter of every rank, from the table and the layers' tp numbers."""
    hf = _hf()
    for rank in range(tp):
        vllm = _fake_vllm(tp, rank)
        targets = VLLMTargets(vllm, [TrainerTensor(n, p) for n, p in hf.items()])
        assert not targets.skipped
        assert set(targets.targets) == {n for n, _ in vllm.named_parameters()}
        for name, t in targets.targets.items():
            got = _fill(t, {n: p.detach() for n, p in hf.items()})
            assert got.shape == dict(vllm.named_parameters())[name].shape, name
        t = targets.targets
        rows = 16 // tp  # the padded vocabulary (16) split over the ranks, real rows first
        emb = hf["model.embed_tokens.weight"].detach()
        real = emb[rank * rows:min(10, (rank + 1) * rows)]
        got = _fill(t["model.embed_tokens.weight"], {"model.embed_tokens.weight": emb})
        assert torch.equal(got[:len(real)], real) and not got[len(real):].any()
        down = hf[f"{LAYER}mlp.down_proj.weight"].detach()
        got = _fill(t[f"{LAYER}mlp.down_proj.weight"], {f"{LAYER}mlp.down_proj.weight": down})
        assert torch.equal(got, down.chunk(tp, dim=1)[rank])


def test_live_targets_tied_head_unknown_tensors_and_disagreement():
    hf = _hf(tie=True)
    targets = VLLMTargets(_fake_vllm(1, 0, tie=True), [TrainerTensor(n, p) for n, p in hf.items()])
    assert "lm_head.weight" not in targets.targets and not targets.skipped  # vLLM's head is the embedding
    extra = {**hf, "model.rotary.inv_freq": torch.nn.Parameter(torch.ones(2))}  # vLLM has no such parameter
    targets = VLLMTargets(_fake_vllm(1, 0, tie=True), [TrainerTensor(n, p) for n, p in extra.items()])
    assert targets.skipped == ["model.rotary.inv_freq"]
    vllm = _fake_vllm(1, 0, tie=True)
    vllm.model.extra = _Layer((3,))
    with pytest.raises(LayoutError, match="model.extra.weight"):
        VLLMTargets(vllm, [TrainerTensor(n, p) for n, p in {**hf, "model.extra.weight": torch.ones(3)}.items()])
    with pytest.raises(LayoutError, match="table gives this rank"):  # a vLLM whose QKV layout is not the table's
        VLLMTargets(_fake_vllm(1, 0, tie=True, qkv_rows=6), [TrainerTensor(n, p) for n, p in hf.items()])


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
    pieces = [SlicePair("q", "qkv", 0, 0, 0, q.shape[0]), SlicePair("k", "qkv", 0, 0, q.shape[0], k.shape[0]),
              SlicePair("v", "qkv", 0, 0, q.shape[0] + k.shape[0], v.shape[0])]
    for param, piece in zip((q, k, v), pieces, strict=True):
        install_alias(param, qkv, piece)
        assert is_alias_of(param.detach(), qkv, piece) and param.is_contiguous()
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    gate_up = torch.empty(2 * gate.shape[0], gate.shape[1])
    install_alias(gate, gate_up, SlicePair("g", "gu", 0, 0, 0, gate.shape[0]))
    install_alias(up, gate_up, SlicePair("u", "gu", 0, 0, gate.shape[0], up.shape[0]))
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
    install_alias(q, fused, SlicePair("q", "f", 0, 0, 0, q.shape[0]))
    install_alias(k, fused, SlicePair("k", "f", 0, 0, q.shape[0], k.shape[0]))
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name

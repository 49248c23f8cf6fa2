"""One process per rank (gloo): Megatron-Core layers at TP=t, a real sharing plan, rollout weights at TP=r.

Every process hosts one training rank and one rollout slot, as a colocated trainer + rollout engine does. For each
(t, r) and each variant the processes:

1. build megatron-core's own parallel layers (``GPTModel`` with the local spec for the LLM; a ``TransformerBlock``
   and Column/RowParallelLinear for a Megatron-native vision tower, or the HF vision module replicated as
   Megatron-Bridge does) and load the tiny HF model's weights with the layout algebra;
2. check the loaded shards through Megatron's own forward code (its QKV split, gated MLP, vocab-parallel embedding,
   row-parallel all-reduce) against plain HF math;
3. move the training parameters into shared-memory arenas, build every vLLM parameter of the rollout slot, and
   check it against an independent vLLM-loader reference, check storage sharing byte by byte (addresses and
   /proc/self/maps), then take real optimizer steps and check aliased tensors follow at once while rebuilt ones
   follow only after ``sync()``.

Results go to ``<out>/rank<k>.json`` as records ``{case, check, ok, detail}``; the pytest side asserts on them.
"""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

DTYPE = torch.float32


def tiny_config(vocab: int = 1000):
    """Qwen2.5-VL small enough for 8 CPU processes, with heads that split 8 ways and 2 KV heads (so r = 4
    replicates KV heads in vLLM and t = 4, 8 split KV groups across Megatron ranks)."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=16, intermediate_size=256, vocab_size=vocab, tie_word_embeddings=False,
                         rms_norm_eps=1e-6),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=8, out_hidden_size=128,
                           patch_size=2, temporal_patch_size=2, in_channels=3, spatial_merge_size=2,
                           fullatt_block_indexes=[1]),
        tie_word_embeddings=False)


def hf_weights(config, seed: int = 0) -> dict[str, torch.Tensor]:
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():  # biases and norms start at 0/1 in HF: make every tensor distinctive
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------- megatron side
def _cpu_all_gather_last_dim(x, group=None):
    """Megatron's all_gather_last_dim_from_tensor_parallel_region allocates on torch.cuda.current_device()
    (mappings.py `_gather_along_last_dim`), which fails without CUDA: the same gather on CPU/gloo."""
    from megatron.core import parallel_state

    group = group or parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def build_megatron(config, t: int, vision: str, vocab: int, hf: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The training model as Megatron-Core (LLM) + a sharded or replicated vision tower, names as in the plan."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlock

    text, vis = config.text_config, config.vision_config
    common = dict(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=1e-6,
                  use_cpu_initialization=True, params_dtype=DTYPE, tensor_model_parallel_size=t,
                  sequence_parallel=False)
    llm_cfg = TransformerConfig(num_layers=text.num_hidden_layers, hidden_size=text.hidden_size,
                                num_attention_heads=text.num_attention_heads,
                                num_query_groups=text.num_key_value_heads, kv_channels=text.head_dim,
                                ffn_hidden_size=text.intermediate_size, add_bias_linear=False, add_qkv_bias=True,
                                **common)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    root = torch.nn.Module()
    root.language_model = GPTModel(llm_cfg, spec, vocab_size=vocab, max_sequence_length=64,
                                   share_embeddings_and_output_weights=False, position_embedding_type="rope")
    if vision == "sharded":
        vit_cfg = TransformerConfig(num_layers=vis.depth, hidden_size=vis.hidden_size,
                                    num_attention_heads=vis.num_heads, num_query_groups=vis.num_heads,
                                    kv_channels=vis.hidden_size // vis.num_heads,
                                    ffn_hidden_size=vis.intermediate_size, add_bias_linear=True, add_qkv_bias=True,
                                    **common)
        vm = torch.nn.Module()
        vm.decoder = TransformerBlock(vit_cfg, spec, post_layer_norm=True)
        vm.patch_embed = torch.nn.Module()  # Megatron-native towers keep a replicated Conv3d
        vm.patch_embed.proj = torch.nn.Conv3d(vis.in_channels, vis.hidden_size, bias=False,
                                              kernel_size=(vis.temporal_patch_size, vis.patch_size, vis.patch_size))
        merged = vis.hidden_size * vis.spatial_merge_size ** 2
        vm.projection = torch.nn.Module()
        vm.projection.encoder = torch.nn.Module()
        init = vit_cfg.init_method
        vm.projection.encoder.linear_fc1 = ColumnParallelLinear(merged, merged, config=vit_cfg, init_method=init,
                                                                bias=True, gather_output=False)
        vm.projection.encoder.linear_fc2 = RowParallelLinear(merged, vis.out_hidden_size, config=vit_cfg,
                                                             init_method=init, bias=True, input_is_parallel=True,
                                                             skip_bias_add=False)
        root.vision_model = vm
    else:  # Megatron-Bridge: the HF vision module itself, replicated on every TP rank
        from transformers import Qwen2_5_VLForConditionalGeneration

        with torch.device("meta"):
            hf_model = Qwen2_5_VLForConditionalGeneration(config)
        root.visual = hf_model.model.visual.to_empty(device="cpu")
    return root


def load(root: torch.nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """Copy the algebra's per-rank tensors into Megatron's parameters; returns shape mismatches (must be none)."""
    params = dict(root.named_parameters())
    problems = sorted(set(params) ^ set(state))
    with torch.no_grad():
        for name, p in params.items():
            if name not in state:
                continue
            x = state[name]
            if x.numel() != p.numel() or (x.dim() == p.dim() and x.shape != p.shape):
                problems.append(f"{name}: megatron {tuple(p.shape)} vs algebra {tuple(x.shape)}")
                continue
            p.copy_(x.reshape(p.shape))
    return problems


def megatron_checks(root, hf, config, t: int, k: int, vision: str, vocab: int) -> list[tuple[str, bool, str]]:
    """Megatron's own forward code on the loaded shards vs plain HF math (all ranks take part: collectives)."""
    import megatron.core.transformer.attention as attention

    attention.all_gather_last_dim_from_tensor_parallel_region = _cpu_all_gather_last_dim
    text, vis = config.text_config, config.vision_config
    out = []

    def close(name, got, want):
        err = (got - want).abs().max().item()
        out.append((f"megatron:{name}", err < 1e-4 * max(1.0, want.abs().max().item()), f"max err {err:.2e}"))

    g = torch.Generator().manual_seed(1)
    pre = "model.language_model.layers.0."
    lm = root.language_model
    layer = lm.decoder.layers[0]
    x = torch.randn(3, 2, text.hidden_size, generator=g)
    nq, nkv, hd = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    with torch.no_grad():
        q, kk, v = layer.self_attention.get_query_key_value_tensors(x)
        heads = slice(k * nq // t, (k + 1) * nq // t)
        kv = slice(k * nkv // t, (k + 1) * nkv // t) if nkv >= t else slice(k // (t // nkv), k // (t // nkv) + 1)
        ref = {n: F.linear(x, hf[f"{pre}self_attn.{n}_proj.weight"], hf[f"{pre}self_attn.{n}_proj.bias"])
               for n in "qkv"}
        close("llm qkv split (q)", q, ref["q"].view(3, 2, nq, hd)[:, :, heads])
        close("llm qkv split (k)", kk, ref["k"].view(3, 2, nkv, hd)[:, :, kv])
        close("llm qkv split (v)", v, ref["v"].view(3, 2, nkv, hd)[:, :, kv])
        z = torch.randn(3, 2, nq * hd, generator=g)
        size = nq * hd // t
        got, _ = layer.self_attention.linear_proj(z[..., k * size:(k + 1) * size])
        close("llm linear_proj (row split + all-reduce)", got, F.linear(z, hf[f"{pre}self_attn.o_proj.weight"]))
        got, bias = layer.mlp(x)
        gate, up = F.linear(x, hf[f"{pre}mlp.gate_proj.weight"]), F.linear(x, hf[f"{pre}mlp.up_proj.weight"])
        want = F.linear(F.silu(gate) * up, hf[f"{pre}mlp.down_proj.weight"])
        close("llm gated MLP (fc1 [gate;up] per rank, fc2 row)", got + (0 if bias is None else bias), want)
        ids = torch.tensor([[0, 5, text.vocab_size - 1]])
        close("vocab-parallel embedding", lm.embedding.word_embeddings(ids),
              hf["model.language_model.embed_tokens.weight"][ids])
        h = torch.randn(3, 2, text.hidden_size, generator=g)
        logits, _ = lm.output_layer(h)
        w = torch.cat([hf["lm_head.weight"], hf["lm_head.weight"].new_zeros(vocab - text.vocab_size, h.shape[-1])])
        per = vocab // t
        close("output layer (vocab-parallel logits)", logits, F.linear(h, w[k * per:(k + 1) * per]))
        if vision == "sharded":
            vp = "model.visual.blocks.0."
            vlayer = root.vision_model.decoder.layers[0]
            xv = torch.randn(5, 1, vis.hidden_size, generator=g)
            nh, vhd = vis.num_heads, vis.hidden_size // vis.num_heads
            q, kk, v = vlayer.self_attention.get_query_key_value_tensors(xv)
            fused = F.linear(xv, hf[f"{vp}attn.qkv.weight"], hf[f"{vp}attn.qkv.bias"]).view(5, 1, 3, nh, vhd)
            heads = slice(k * nh // t, (k + 1) * nh // t)
            for i, (name, got) in enumerate((("q", q), ("k", kk), ("v", v))):
                close(f"vit per-head qkv split ({name})", got, fused[:, :, i, heads])
            got, bias = vlayer.mlp(xv)
            want = F.linear(F.silu(F.linear(xv, hf[f"{vp}mlp.gate_proj.weight"], hf[f"{vp}mlp.gate_proj.bias"]))
                            * F.linear(xv, hf[f"{vp}mlp.up_proj.weight"], hf[f"{vp}mlp.up_proj.bias"]),
                            hf[f"{vp}mlp.down_proj.weight"], hf[f"{vp}mlp.down_proj.bias"])
            close("vit gated MLP with biases", got + bias, want)
            enc = root.vision_model.projection.encoder
            xm = torch.randn(4, 1, enc.linear_fc1.input_size, generator=g)
            mid, _ = enc.linear_fc1(xm)
            full = F.linear(xm, hf["model.visual.merger.mlp.0.weight"], hf["model.visual.merger.mlp.0.bias"])
            per = full.shape[-1] // t
            close("merger fc1 (column split)", mid, full[..., k * per:(k + 1) * per])
            got, _ = enc.linear_fc2(full[..., k * per:(k + 1) * per])
            close("merger fc2 (row split + all-reduce)", got,
                  F.linear(full, hf["model.visual.merger.mlp.2.weight"], hf["model.visual.merger.mlp.2.bias"]))
    return out


# ---------------------------------------------------------------------------------------------- the case
def run_case(rank: int, world: int, t: int, r: int, variant: dict, config, hf, session: str) -> list[dict]:
    from megatron.core import parallel_state
    from vllm_reference import vllm_rank_weights

    from rollplex_trl.sharding import ShardingOptions, model_spec_from_config, plan_sharding
    from rollplex_trl.sharding.executor import CpuMemory, RolloutWeights, TrainingStorage
    from rollplex_trl.sharding.materialize import framework_state
    from rollplex_trl.sharding.shm import backing_of
    from rollplex_trl.sharding.views import view_linear

    records: list[dict] = []
    case = f"t{t}-r{r}-{variant['name']}"

    def record(check: str, ok: bool, detail: str = ""):
        records.append({"case": case, "t": t, "r": r, "variant": variant["name"], "rank": rank, "check": check,
                        "ok": bool(ok), "detail": detail})

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=t)
    k = parallel_state.get_tensor_model_parallel_rank()
    assert k == rank % t, "device d must host training rank d % t"
    memory = CpuMemory()
    options = ShardingOptions(train_tp=t, rollout_tp=r, world_size=world, megatron_vision=variant["vision"],
                              megatron_vocab_multiple=variant["vocab_multiple"], page_size=memory.page,
                              element_size=4, remote=variant["remote"])
    model = model_spec_from_config(config, "tiny-qwen2.5-vl")
    plan = plan_sharding(model, options)
    vocab = options_vocab = config.text_config.vocab_size
    if options.megatron_vocab_multiple:
        m = options.megatron_vocab_multiple * t
        options_vocab = -(-vocab // m) * m

    # 1-2. Megatron-Core layers, loaded through the algebra, checked by Megatron's own forwards.
    root = build_megatron(config, t, variant["vision"], options_vocab, hf)
    problems = load(root, framework_state(model, options, "train", k, hf))
    record("megatron layer shapes == algebra shapes", not problems, "; ".join(problems[:5]))
    for name, ok, detail in megatron_checks(root, hf, config, t, k, variant["vision"], options_vocab):
        record(name, ok, detail)

    # 3. Training storage in shared memory; rollout weights as views of it.
    storage = TrainingStorage(plan, rank, memory, session, DTYPE)
    params = dict(root.named_parameters())
    storage.adopt(params)
    dist.barrier()
    rollout = RolloutWeights(plan, rank, memory, session, storage)
    dist.barrier()
    j = plan.devices[rank].rollout_rank
    vision_tp = True

    def reference(weights):
        return vllm_rank_weights(weights, config, r, j, vision_tp)

    ref = reference(hf)
    record("rollout names == vLLM reference names", set(ref) == set(rollout.tensors),
           str(sorted(set(ref) ^ set(rollout.tensors))[:4]))
    rollout.sync()
    bad = [n for n in ref if n in rollout.tensors and not torch.equal(rollout.logical(n), ref[n])]
    record("every rollout tensor == vLLM loader slicing of the HF weight", not bad, str(bad[:4]))

    # Sharing: direct views lie inside the training tensor's storage; stitched pages are the arena's pages.
    arena_path = storage.file.path
    direct_ok, mapped_ok, shared = [], [], 0
    for name, lay in rollout.layouts.items():
        tensor = rollout.tensors[name]
        if lay.mode == "direct":
            shared += 1
            m, kk = lay.holders[int(lay.result.runs.holder[0])] if lay.cls == "aligned" else \
                lay.holders[lay.result.view.blocks[0]]
            owner = params[plan.arena_entry(kk, lay.group, m).name]
            lo, hi = owner.data_ptr(), owner.data_ptr() + owner.numel() * owner.element_size()
            span = sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride())) * tensor.element_size()
            inside = (tensor.untyped_storage().data_ptr() == storage.raw.untyped_storage().data_ptr()
                      and lo <= tensor.data_ptr() and tensor.data_ptr() + span + tensor.element_size() <= hi)
            direct_ok.append((name, inside))
        elif lay.mode == "mapped":
            shared += 1
            rng = rollout.ranges[name]
            for p in lay.spans:
                path, offset = backing_of(rng.addr + p.va) or ("", -1)
                if p.source == "train":
                    t_dev = rank if p.train_rank == k else (rank // t) * t + p.train_rank
                    want = arena_path.replace(f"-train-{rank}", f"-train-{t_dev}")
                else:
                    want = rollout.buffer.path
                mapped_ok.append((name, path.split(" ")[0] == want and offset == p.offset))
    record("direct views lie inside the training tensor's storage", all(ok for _, ok in direct_ok),
           str([n for n, ok in direct_ok if not ok][:4]) + f" ({len(direct_ok)} tensors)")
    record("stitched pages are backed by the training arena's file pages (/proc/self/maps)",
           all(ok for _, ok in mapped_ok), str([n for n, ok in mapped_ok if not ok][:4]) + f" ({len(mapped_ok)} pages)")
    record("some tensors are shared", shared > 0, f"{shared} of {len(rollout.tensors)}")

    # View-class weights work in a blocked GEMM without materializing them.
    g = torch.Generator().manual_seed(2)
    vl_bad = []
    for name, lay in rollout.layouts.items():
        if lay.cls == "view" and lay.result.view.row_dims > 0:
            x = torch.randn(3, ref[name].shape[1], generator=g)
            got = view_linear(x, rollout.tensors[name], lay.result.view.row_dims)
            want = F.linear(x, ref[name])
            if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
                vl_bad.append(f"{name}: max err {(got - want).abs().max().item():.2e} of {want.abs().max().item():.1f}")
    record("view_linear(x, view) == F.linear(x, vLLM weight)", not vl_bad, str(vl_bad[:4]))

    # Optimizer steps on the Megatron parameters (in the arena): SGD with grad = -p doubles every weight exactly.
    buffer_ptr = rollout._buf.data_ptr()
    dist.barrier()  # peers read this rank's pages until here: only then may the optimizer write them
    optimizer = torch.optim.SGD(list(params.values()), lr=1.0)
    weights = hf
    for step in (1, 2):
        for p in params.values():
            p.grad = -p.detach().clone()
        optimizer.step()
        dist.barrier()  # every rank's step is done: peers' pages are current too
        old, weights = ref, {n: w * 2 for n, w in weights.items()}
        ref = reference(weights)
        stale, fresh, follow = [], [], []
        for name, lay in rollout.layouts.items():
            got = rollout.logical(name)
            if lay.copied_bytes == 0:
                follow.append((name, torch.equal(got, ref[name])))
            elif lay.mode == "buffer" and lay.copied_bytes == lay.nbytes:
                stale.append((name, torch.equal(got, old[name])))
        stats = rollout.sync()
        for name in rollout.layouts:
            fresh.append((name, torch.equal(rollout.logical(name), ref[name])))
        record(f"step {step}: aliased tensors follow the optimizer with no sync",
               all(ok for _, ok in follow), f"{sum(ok for _, ok in follow)}/{len(follow)}")
        record(f"step {step}: rebuilt tensors are stale before sync (they are copies)",
               all(ok for _, ok in stale), f"{sum(ok for _, ok in stale)}/{len(stale)}")
        record(f"step {step}: every tensor is current after sync", all(ok for _, ok in fresh),
               str([n for n, ok in fresh if not ok][:4]) + f"; sync moved {stats['bytes']} bytes "
               f"({stats['from_peers']} from peers) in {stats['buckets']} bucket(s)")
        record(f"step {step}: sync moved what the plan says", stats["bytes"] == sum(
            lay.copied_bytes for lay in rollout.layouts.values()), str(stats))
        record(f"step {step}: the rebuild buffer is reused", rollout._buf.data_ptr() == buffer_ptr)
        dist.barrier()  # nobody steps again while another rank is still reading

    summary = plan.summary()
    record("plan summary", True, json.dumps({"by_params": summary["by_params"],
                                             "per_gpu_bytes": summary["per_gpu_bytes"]}))
    dist.barrier()
    rollout.close()
    dist.barrier()
    storage.close()
    parallel_state.destroy_model_parallel()
    return records


VARIANTS = (
    dict(name="bridge", vision="replicated", vocab_multiple=0, remote="map"),
    dict(name="native", vision="sharded", vocab_multiple=16, remote="copy"),
)


def main(rank: int, world: int, port: int, cases: list, out_dir: str, session: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    records: list[dict] = []
    try:
        config = tiny_config()
        hf = hf_weights(config)
        for t, r, variant in cases:
            records += run_case(rank, world, t, r, variant, config, hf, f"{session}{t}{r}{variant['name']}")
    except Exception:
        records.append({"case": "worker", "rank": rank, "check": "no exception", "ok": False,
                        "detail": traceback.format_exc()})
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
        dist.destroy_process_group()

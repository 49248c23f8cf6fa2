"""This machine's rates, measured once, so the step model can be checked against the CPU benchmarks.

What is measured (each the median of a few repeats, on the threads torch is given):

- matmul FLOP/s, fp32 and bf16, of one decoder layer's projections at the model's own shapes (1024 tokens): what
  a GEMM-bound phase reaches here (the GPU table's peak x mfu); at these small shapes a CPU reaches well under its
  peak, and less on a 512 x 128 K/V projection than on the MLP's, so the shapes matter;
- attention FLOP/s: PyTorch's fused causal attention at the model's heads (512 tokens);
- memory bandwidth: a large tensor copy (read + write bytes / seconds): what a bandwidth-bound phase reaches;
- overheads, because at the benchmarks' sizes a CPU step is not all FLOPs: transformers runs each decoder layer as
  a dozen Python-dispatched modules. Timed on a 1-token forward of a tiny Qwen2 (hidden 64: its FLOPs are
  negligible) with 2 and 6 layers: the difference / 4 is the per-layer cost, the rest the per-call cost; a tiny
  model's `generate` per token, less one forward, is the decode loop's per-token cost (sampling, stopping,
  cache bookkeeping); the tiny Qwen2.5-VL's vision tower on one 16-frame clip, per block, is the vision tower's
  per-run cost (window attention runs per window). On a GPU these are kernel-launch latencies and are left at 0
  (CUDA graphs in vLLM).

None of these is fitted to a benchmark's result: they are this machine's properties, measured on other workloads.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from rollplex_trl.memory.model_dims import ModelDims
from rollplex_trl.planning.hardware import Hardware


def _median_s(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(dims: ModelDims, dtype: str = "fp32", tokens: int = 1024, repeats: int = 7) -> float:
    """FLOP/s of one decoder layer's projections (q, k, v, o, gate, up, down) for `tokens` tokens, run in turn."""
    import torch

    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    h, d, i = dims.hidden, dims.head_dim, dims.intermediate
    shapes = [(h, dims.heads * d), (h, dims.kv_heads * d), (h, dims.kv_heads * d), (dims.heads * d, h), (h, i),
              (h, i), (i, h)]
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(tokens, k, generator=gen, dtype=dt) for k in {k for k, _ in shapes}}
    weights = [torch.randn(k, n, generator=gen, dtype=dt) for k, n in shapes]

    def run():
        for (k, _), w in zip(shapes, weights, strict=True):
            inputs[k] @ w

    return sum(2.0 * tokens * k * n for k, n in shapes) / _median_s(run, repeats)


def attention_flops(dims: ModelDims, dtype: str = "fp32", seq: int = 512, repeats: int = 7) -> float:
    """FLOP/s of causal scaled-dot-product attention at the model's heads (the modelled causal half counted)."""
    import torch
    import torch.nn.functional as F

    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, dims.heads, seq, dims.head_dim, generator=gen, dtype=dt) for _ in range(3))
    flops = 4.0 * dims.heads * dims.head_dim * seq * seq / 2
    return flops / _median_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats)


def memory_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    import torch

    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() * 4 / _median_s(lambda: dst.copy_(src), repeats)


def _tiny_model(layers: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return Qwen2ForCausalLM(config).eval()


def overheads(repeats: int = 30) -> dict[str, float]:
    """(per-call, per-layer, per-decode-step) seconds of transformers' Python on this machine."""
    import torch

    ids = torch.tensor([[5]])
    forward = {}
    models = {}
    for layers in (2, 6):
        model = models[layers] = _tiny_model(layers)
        with torch.no_grad():
            forward[layers] = _median_s(lambda m=model: m(input_ids=ids), repeats)
    per_layer = max((forward[6] - forward[2]) / 4, 0.0)
    per_call = max(forward[2] - 2 * per_layer, 0.0)
    tokens = 24
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        gen = _median_s(lambda: models[2].generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens,
                                                    do_sample=True, pad_token_id=0), 5, warmup=1)
    per_step = max(gen / tokens - forward[2], 0.0)
    return {"call_overhead_s": per_call, "layer_overhead_s": per_layer, "decode_step_overhead_s": per_step,
            "vision_block_overhead_s": vision_block_overhead(repeats)}


def vision_block_overhead(repeats: int = 10) -> float:
    """Seconds per vision-tower block of the tiny Qwen2.5-VL's tower (hidden 32: FLOPs negligible) on one
    16-frame 112 x 112 clip: the window attention's per-window Python and small kernels."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex_trl.testing.checkpoints import get_checkpoint

    path = get_checkpoint("qwen2_5_vl", "tiny")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, attn_implementation="sdpa").eval()
    visual = model.model.visual
    grid = torch.tensor([[8, 8, 8]])  # 16 frames of 112 x 112: temporal patch 2, 14-pixel patches
    cfg = model.config.vision_config
    pixels = torch.randn(int(grid.prod()), cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2)
    with torch.no_grad():
        seconds = _median_s(lambda: visual(pixels, grid_thw=grid), repeats)
    return seconds / cfg.depth


def calibrate(dims: ModelDims, quick: bool = False) -> dict[str, float]:
    """Measure this machine at `dims`' shapes: GEMM and attention FLOP/s (fp32, bf16), bandwidth, overheads."""
    reps = 3 if quick else 7
    out = {"fp32_flops": matmul_flops(dims, "fp32", repeats=reps),
           "bf16_flops": matmul_flops(dims, "bf16", repeats=reps),
           "fp32_attention_flops": attention_flops(dims, "fp32", repeats=reps),
           "bf16_attention_flops": attention_flops(dims, "bf16", repeats=reps),
           "mem_bw": memory_bandwidth(repeats=reps)}
    out.update(overheads(repeats=10 if quick else 30))
    return out


def cpu_hardware(rates: dict[str, float], threads_share: float = 1.0) -> Hardware:
    """The `cpu` entry: measured rates (already achieved ones: mfu = mbu = 1), one device, no links beyond memory.
    `threads_share` scales compute and bandwidth for a rank that gets part of the cores (Megatron t = 2 on 2 cores:
    0.5)."""
    bw = rates["mem_bw"] * threads_share
    return Hardware(
        name="cpu", peak_flops=rates["bf16_flops"] * threads_share, fp32_flops=rates["fp32_flops"] * threads_share,
        attention_flops=rates["bf16_attention_flops"] * threads_share,
        fp32_attention_flops=rates["fp32_attention_flops"] * threads_share,
        mem_bw=bw, intra_bw=bw, inter_bw=bw, host_bw=0.0, mem_gib=1e9, gpus_per_node=64, mfu=1.0, mbu=1.0,
        collective_latency_s=0.0, overheads_occupy_compute=True, layer_overhead_s=rates["layer_overhead_s"],
        call_overhead_s=rates["call_overhead_s"], decode_step_overhead_s=rates["decode_step_overhead_s"],
        vision_block_overhead_s=rates.get("vision_block_overhead_s", 0.0),
        source="this machine, measured by planning/calibrate.py")

"""This machine's rates, measured once, so the step model can be checked against the CPU benchmarks.

What is measured (each the median of a few repeats, on the threads torch is given):

- matmul FLOP/s, fp32 and bf16, of the decoder layers' projections at the model's own shapes (1024 tokens, each
  layer's own weights, as a forward streams them: one layer's alone would stay in the last-level cache): what a
  GEMM-bound phase reaches here (the GPU table's peak x mfu); at these small shapes a CPU reaches well under its
  peak, and less on a 512 x 128 K/V projection than on the MLP's, so the shapes matter; and the same at 64 and 256
  rows, and at the vision blocks' shapes, relative to it (`gemm_efficiency`): a 289-token prefix or a 64-token
  suffix runs its GEMMs at a fraction of the 1024-token rate;
- attention FLOP/s: PyTorch's fused causal attention at the model's heads (512 tokens);
- memory bandwidth: a large tensor copy (read + write bytes / seconds): what a bandwidth-bound phase reaches;
- decode bandwidth: the weight bytes per second of the decoder layers' GEMMs on 8 rows (a decode step's batch),
  every layer's weights streamed in turn as a decode step reads them: on a CPU these skinny GEMMs read their
  weights at a third of a copy's bandwidth, so decode is priced at this rate;
- overheads, because at the benchmarks' sizes a CPU step is not all FLOPs: transformers runs each decoder layer as
  a dozen Python-dispatched modules. Timed on a 1-token forward of a tiny Qwen2 (hidden 64: its FLOPs are
  negligible) with 1, 3 and 6 layers, in turns: the slope of a line through them is the per-layer cost, its
  intercept the per-call cost; the decode loop's per-step and per-layer costs are timed the same way on Rollplex's
  own transformers rollout (`generate_with_shared_prefill`, shared-prefix decoding on and off) over a tiny
  Qwen2.5-VL with 1 and 6 layers (sampling, stopping, cache bookkeeping, the two-part attention, M-RoPE); the
  tiny Qwen2.5-VL's vision tower on one 16-frame clip, per block, is the vision tower's per-run cost (window
  attention runs per window). On a GPU these are kernel-launch latencies and are left at 0 (CUDA graphs in vLLM).

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


GEMM_TOKENS = (64, 256, 1024)  # rows per GEMM the efficiency curve is measured at (1024: the reference; held beyond)


def _llm_shapes(dims: ModelDims) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's projections: q, k, v, o, gate, up, down."""
    h, d, i = dims.hidden, dims.head_dim, dims.intermediate
    return [(h, dims.heads * d), (h, dims.kv_heads * d), (h, dims.kv_heads * d), (dims.heads * d, h), (h, i),
            (h, i), (i, h)]


def _vision_shapes(dims: ModelDims) -> list[tuple[int, int]]:
    """(in, out) of one vision-tower block's projections: qkv, proj, the MLP (gated: gate and up)."""
    v = dims.vision
    mlp = [(v.hidden, v.intermediate)] * (2 if v.gated_mlp else 1) + [(v.intermediate, v.hidden)]
    return [(v.hidden, 3 * v.hidden), (v.hidden, v.hidden), *mlp]


def _copies(shapes: list[tuple[int, int]], layers: int, max_bytes: int = 512 * 2**20) -> int:
    """How many layers' weights a measurement streams: a forward reads each layer's weights once, so repeating
    one layer's (11 MB at the `small` preset, under a 32 MB last-level cache) would measure a cache-hot rate."""
    return max(1, min(layers, max_bytes // sum(4 * k * n for k, n in shapes)))


def _gemm_runner(shapes: list[tuple[int, int]], dtype: str, tokens: int, layers: int = 1
                 ) -> tuple[Callable[[], None], float]:
    """A function running `shapes`' GEMMs (nn.Linear's layout) on `tokens` rows in turn, through `layers` copies
    of the weights (`_copies`), and its FLOPs."""
    import torch

    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(tokens, k, generator=gen, dtype=dt) for k in {k for k, _ in shapes}}
    copies = _copies(shapes, layers)
    weights = [[torch.randn(n, k, generator=gen, dtype=dt) for k, n in shapes] for _ in range(copies)]

    def run() -> None:
        for layer in weights:
            for (k, _), w in zip(shapes, layer, strict=True):
                torch.nn.functional.linear(inputs[k], w)

    return run, copies * sum(2.0 * tokens * k * n for k, n in shapes)


def matmul_flops(dims: ModelDims, dtype: str = "fp32", tokens: int = 1024, repeats: int = 15) -> float:
    """FLOP/s of the decoder layers' projections (q, k, v, o, gate, up, down) for `tokens` tokens, run in turn,
    each layer's own weights (`_copies`)."""
    run, flops = _gemm_runner(_llm_shapes(dims), dtype, tokens, dims.layers)
    return flops / _median_s(run, repeats)


def gemm_efficiency(dims: ModelDims, dtype: str = "fp32", repeats: int = 5) -> dict[str, float]:
    """The GEMM rate at other row counts, relative to the decoder layer's at 1024 rows (`matmul_flops`): keys
    "{dtype}:llm:{rows}" for the decoder layer's shapes and "{dtype}:vision:{rows}" for a vision block's (its
    patches). A forward's GEMMs have as many rows as it has tokens; a CPU (like a GPU) reaches less of its peak on
    a 289-token prefix or a 64-wide vision projection than on 1024 x 1376, so the step model prices each phase at
    its own size. Timed in turns with the reference, so a drift of the machine cancels out of the ratios."""
    runs, flops = {}, {}
    towers = [("llm", _llm_shapes(dims), dims.layers)]
    if dims.vision:
        towers.append(("vision", _vision_shapes(dims), dims.vision.depth))
    for tower, shapes, layers in towers:
        for rows in GEMM_TOKENS:
            key = f"{dtype}:{tower}:{rows}"
            runs[key], flops[key] = _gemm_runner(shapes, dtype, rows, layers)
    seconds = _round_robin_medians(runs, repeats, warmup=1)
    reference = flops[f"{dtype}:llm:1024"] / seconds[f"{dtype}:llm:1024"]
    return {k: flops[k] / seconds[k] / reference for k in runs}


def attention_flops(dims: ModelDims, dtype: str = "fp32", seq: int = 512, repeats: int = 7) -> float:
    """FLOP/s of causal scaled-dot-product attention at the model's heads (the modelled causal half counted)."""
    import torch
    import torch.nn.functional as F

    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, dims.heads, seq, dims.head_dim, generator=gen, dtype=dt) for _ in range(3))
    flops = 4.0 * dims.heads * dims.head_dim * seq * seq / 2
    return flops / _median_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats)


def decode_attention_flops(dims: ModelDims, dtype: str = "fp32", rows: int = 8, keys: int = 256,
                           repeats: int = 7) -> float:
    """FLOP/s of scaled-dot-product attention at one query per row over `keys` cached keys (a decode step), as
    transformers calls it without a mask (grouped K/V heads passed as they are: `enable_gqa`)."""
    import torch
    import torch.nn.functional as F

    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, dims.heads, 1, dims.head_dim, generator=gen, dtype=dt)
    k, v = (torch.randn(rows, dims.kv_heads, keys, dims.head_dim, generator=gen, dtype=dt) for _ in range(2))
    gqa = dims.heads != dims.kv_heads
    flops = 4.0 * rows * dims.heads * dims.head_dim * keys
    return flops / _median_s(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa), repeats * 5)


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


def _round_robin_medians(fns: dict, rounds: int, warmup: int = 3) -> dict:
    """Median seconds of each function, timed in turns (one call of each per round), so that a drift of the
    machine's speed during the measurement reaches every function alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def _line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of seconds against layers, both floored at 0."""
    xs = list(points)
    mean_x = sum(xs) / len(xs)
    mean_y = sum(points.values()) / len(xs)
    slope = sum((x - mean_x) * (points[x] - mean_y) for x in xs) / sum((x - mean_x) ** 2 for x in xs)
    slope = max(slope, 0.0)
    return slope, max(mean_y - slope * mean_x, 0.0)


def overheads(repeats: int = 30) -> dict[str, float]:
    """Per-call and per-layer seconds of transformers' Python on this machine (1-token forwards of tiny Qwen2
    models with 1, 3 and 6 layers, timed in turns: the slope of a line through them per layer, its intercept per
    call), the decode loop's (`decode_overheads`) and the vision tower's per block."""
    import torch

    ids = torch.tensor([[5]])
    depths = (1, 3, 6)
    models = {n: _tiny_model(n) for n in depths}
    with torch.no_grad():
        fwd = _round_robin_medians({n: (lambda m=models[n]: m(input_ids=ids)) for n in depths}, repeats)
    per_layer, per_call = _line(fwd)
    return {"call_overhead_s": per_call, "layer_overhead_s": per_layer,
            **decode_overheads(max(3, repeats // 6)), "vision_block_overhead_s": vision_block_overhead(repeats)}


def _tiny_vl(layers: int):
    """The tiny Qwen2.5-VL test checkpoint's architecture with `layers` decoder layers, random weights."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from rollplex_trl.testing.checkpoints import get_checkpoint

    config = AutoConfig.from_pretrained(get_checkpoint("qwen2_5_vl", "tiny"))
    config.text_config.num_hidden_layers = layers
    config.text_config.layer_types = ["full_attention"] * layers
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def decode_overheads(repeats: int = 5, rows: int = 8, tokens: int = 24) -> dict[str, float]:
    """Seconds per decode step of Rollplex's transformers rollout outside the counted work: sampled generation of
    `tokens` tokens for `rows` rows of one 16-token prompt through `generate_with_shared_prefill`, on the tiny
    Qwen2.5-VL (hidden 64: FLOPs and bytes negligible) with 1 and 6 decoder layers, with shared-prefix decoding
    and without. Per layer (the slope): the attention's two parts, M-RoPE, the cache; per step (the intercept):
    the model's wrapper, the head, sampling, logits processors, stopping."""
    import torch

    from rollplex_trl.prefix.generation import generate_with_shared_prefill

    depths = (1, 6)
    models = {n: _tiny_vl(n) for n in depths}
    ids = torch.randint(10, 200, (1, 16), generator=torch.Generator().manual_seed(0)).repeat(rows, 1)
    mask = torch.ones_like(ids)

    def run(model, shared: str):
        def go():
            with torch.no_grad():
                generate_with_shared_prefill(model, ids, mask, None, shared_decode=shared, num_generations=rows,
                                             max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True,
                                             pad_token_id=0)
        return go

    fns = {(n, shared): run(models[n], shared) for n in depths for shared in ("on", "off")}
    times = _round_robin_medians(fns, repeats, warmup=1)
    plain_layer, plain_step = _line({n: times[(n, "off")] / tokens for n in depths})
    shared_layer, shared_step = _line({n: times[(n, "on")] / tokens for n in depths})
    return {"decode_step_overhead_s": (plain_step + shared_step) / 2, "decode_layer_overhead_s": plain_layer,
            "shared_decode_layer_overhead_s": shared_layer}


def decode_bandwidth(dims: ModelDims, rows: int = 8, repeats: int = 7, dtype: str = "fp32") -> float:
    """Bytes/s at which GEMMs of `rows` rows (a decode step's batch) read the decoder layers' weights at `dtype`:
    what decoding reaches here (a CPU's skinny GEMMs stream their weights well below a copy's bandwidth, and bf16
    ones at their own rate). A decode step reads every layer once, so each layer's own weights are streamed in
    turn (`_copies`)."""
    shapes = _llm_shapes(dims)
    run, flops = _gemm_runner(shapes, dtype, rows, dims.layers)
    weight_bytes = flops / (2.0 * rows) * (4 if dtype == "fp32" else 2)  # 2 FLOPs per weight per row
    return weight_bytes / _median_s(run, repeats * 5)


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


def _vision_tower(dims: ModelDims):
    """A Qwen2.5-VL vision tower of `dims`' sizes (random weights; full-attention blocks spread evenly)."""
    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    v = dims.vision
    full = v.full_attention_blocks if v.window else v.depth
    config = Qwen2_5_VLVisionConfig(
        depth=v.depth, hidden_size=v.hidden, intermediate_size=v.intermediate, num_heads=v.heads, patch_size=v.patch,
        temporal_patch_size=v.temporal_patch, spatial_merge_size=v.merge, out_hidden_size=v.out_hidden,
        in_channels=v.in_channels, window_size=v.window or 10**6, hidden_act="silu",
        fullatt_block_indexes=[round((i + 1) * v.depth / full) - 1 for i in range(full)], attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2_5_VisionTransformerPretrainedModel(config)


VISION_TOWER_SIZE = 448  # the image the tower factors are measured on (1,024 patches: one 448 x 448 image)


def vision_tower_factors(dims: ModelDims, rates: dict[str, float], dtype: str = "fp32",
                         repeats: int = 5) -> dict[str, float]:
    """The vision tower run whole on one 448 x 448 image, forward and forward + backward, against the step model's
    price of the same run at `rates`: measured seconds beyond its priced elementwise kernels and block overheads,
    over the priced seconds of its FLOPs. On a CPU its convolution, attention backward and layout copies run well
    below the GEMM rate (small preset, fp32: ~1.2 forward, ~1.6 trained). Qwen2.5-VL's layout only (gated MLP):
    {} for other towers; {} for towers too large to run here in seconds (over 20 GFLOP per image). Keys:
    "fp32_vision_forward_factor", "fp32_vision_train_factor" (and bf16)."""
    import torch

    from rollplex_trl.planning.step_model import vision_tower_seconds
    from rollplex_trl.prefix.cost import vision_flops_per_visual_token

    v = dims.vision
    side = VISION_TOWER_SIZE // v.patch if v else 0
    visual = side * side / v.merge**2 if v else 0
    if v is None or not v.gated_mlp or vision_flops_per_visual_token(dims, (side, side)) * visual > 20e9:
        return {}
    tower = _vision_tower(dims)
    if dtype == "bf16":
        tower = tower.to(torch.bfloat16)
    grid = torch.tensor([[1, side, side]])
    pixels = torch.randn(side * side, v.in_channels * v.temporal_patch * v.patch**2,
                         generator=torch.Generator().manual_seed(0)).to(next(tower.parameters()).dtype)

    def forward():
        with torch.no_grad():
            tower(pixels, grid_thw=grid)

    def train():
        out = tower(pixels, grid_thw=grid)
        hidden = out.pooler_output if hasattr(out, "pooler_output") else out
        hidden.float().square().mean().backward()

    measured = _round_robin_medians({"forward": forward, "train": train}, repeats, warmup=2)
    hw = cpu_hardware(rates)
    out = {}
    for kind, seconds in measured.items():
        priced, flops_s = vision_tower_seconds(dims, hw, dtype, (side, side), visual, train=kind == "train")
        out[f"{dtype}_vision_{kind}_factor"] = max(0.1, (seconds - (priced - flops_s)) / flops_s)
    return out


def _allreduce_worker(rank: int, world: int, port: int, rounds: int, numel: int) -> None:
    """One rank of `collective_latency` (its own interpreter): rank 0 prints the median seconds per all-reduce."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x = torch.ones(numel)
        for _ in range(20):
            dist.all_reduce(x)
        times = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        if rank == 0:
            print(statistics.median(times), flush=True)
    finally:
        dist.destroy_process_group()


def collective_latency(world: int = 2, rounds: int = 100, numel: int = 4096) -> float:
    """Seconds of one gloo all-reduce of `numel` fp32 values (a decode step's activations) between `world`
    processes of one thread each on this machine: what each tensor-parallel collective of a CPU run pays (Megatron
    t = 2 here) beyond its bytes over the copy bandwidth. The ranks are fresh interpreters (subprocesses), so the
    caller needs no `__main__` guard."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", "from rollplex_trl.planning.calibrate import _allreduce_worker; "
                               f"_allreduce_worker({rank}, {world}, {port}, {rounds}, {numel})"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(world)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"the all-reduce calibration's rank failed:\n{err[-2000:]}")
    return float(outputs[0][0].strip().splitlines()[-1])


def calibrate(dims: ModelDims, quick: bool = False, collectives: bool = False) -> dict[str, float]:
    """Measure this machine at `dims`' shapes: GEMM and attention FLOP/s (fp32, bf16), bandwidth, overheads, and
    with `collectives` the latency of a two-process gloo all-reduce."""
    reps = 3 if quick else 7
    out = {"fp32_flops": matmul_flops(dims, "fp32", repeats=2 * reps + 1),
           "bf16_flops": matmul_flops(dims, "bf16", repeats=reps),
           "fp32_attention_flops": attention_flops(dims, "fp32", repeats=reps),
           "bf16_attention_flops": attention_flops(dims, "bf16", repeats=reps),
           "fp32_decode_attention_flops": decode_attention_flops(dims, "fp32", repeats=reps),
           "bf16_decode_attention_flops": decode_attention_flops(dims, "bf16", repeats=reps),
           "mem_bw": memory_bandwidth(repeats=reps), "decode_bw": decode_bandwidth(dims, repeats=reps),
           "bf16_decode_bw": decode_bandwidth(dims, repeats=reps, dtype="bf16"),
           **gemm_efficiency(dims, "fp32", repeats=reps), **gemm_efficiency(dims, "bf16", repeats=reps)}
    out.update(overheads(repeats=10 if quick else 30))
    out.update(vision_tower_factors(dims, out, "fp32", repeats=reps))
    out.update(vision_tower_factors(dims, out, "bf16", repeats=reps))
    if collectives:
        out["collective_latency_s"] = collective_latency()
    return out


def cpu_hardware(rates: dict[str, float], threads_share: float = 1.0) -> Hardware:
    """The `cpu` entry: measured rates (already achieved ones: mfu = mbu = 1), one device, no links beyond memory;
    the GEMM rate at other sizes as measured (`gemm_efficiency`; calibrations before it: one rate for all).
    `threads_share` scales compute and bandwidth for a rank that gets part of the cores (Megatron t = 2 on 2 cores:
    0.5)."""
    bw = rates["mem_bw"] * threads_share
    return Hardware(
        name="cpu", peak_flops=rates["bf16_flops"] * threads_share, fp32_flops=rates["fp32_flops"] * threads_share,
        attention_flops=rates["bf16_attention_flops"] * threads_share,
        fp32_attention_flops=rates["fp32_attention_flops"] * threads_share,
        # calibrations before the decode attention was measured apart: the attention rate
        decode_attention_flops=rates.get("bf16_decode_attention_flops", 0.0) * threads_share or None,
        fp32_decode_attention_flops=rates.get("fp32_decode_attention_flops", 0.0) * threads_share or None,
        mem_bw=bw, intra_bw=bw, inter_bw=bw, host_bw=0.0, mem_gib=1e9, gpus_per_node=64, mfu=1.0, mbu=1.0,
        collective_latency_s=rates.get("collective_latency_s", 0.0), overheads_occupy_compute=True,
        layer_overhead_s=rates["layer_overhead_s"],
        call_overhead_s=rates["call_overhead_s"],
        # calibrations before the decode loop was measured on its own: a step was a forward call plus the loop's
        decode_step_overhead_s=rates["decode_step_overhead_s"] + (
            0.0 if "decode_layer_overhead_s" in rates else rates["call_overhead_s"]),
        decode_layer_overhead_s=rates.get("decode_layer_overhead_s"),
        shared_decode_layer_overhead_s=rates.get("shared_decode_layer_overhead_s"),
        decode_bw=rates["decode_bw"] * threads_share if "decode_bw" in rates else None,
        bf16_decode_bw=rates["bf16_decode_bw"] * threads_share if "bf16_decode_bw" in rates else None,
        vision_block_overhead_s=rates.get("vision_block_overhead_s", 0.0),
        gemm_efficiency={k: v for k, v in rates.items() if k.count(":") == 2} or None,  # "fp32:llm:256": 0.8
        vision_tower_factors={f"{p}:{k}": rates[f"{p}_vision_{k}_factor"] for p in ("fp32", "bf16")
                              for k in ("forward", "train") if f"{p}_vision_{k}_factor" in rates} or None,
        source="this machine, measured by planning/calibrate.py")

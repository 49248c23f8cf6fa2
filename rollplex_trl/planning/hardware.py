"""The devices `plan-run` prices a step on: peak rates as published, and how much of them a step gets.

A phase is priced by its bottleneck: compute (prefill, scoring, training: FLOPs / (peak x `mfu`)), device memory
(decode: bytes read per token / (HBM bandwidth x `mbu`)), or a link (collectives and weight sync: bytes / link
bandwidth, plus a latency per collective). The peaks are the vendors' dense (no sparsity) bf16 figures; `mfu` and
`mbu` are assumptions (printed with every plan), not measurements: 45% of peak is what Megatron-LM reports for
large-model training on H100 at these sizes, 70% of HBM bandwidth what vLLM's decode kernels reach at batch sizes
of a GRPO rollout.

Sources (checked against the datasheets, 2024-2025):
- H100 SXM5 80GB: 989.4 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4 900 GB/s total (450 GB/s each way); nodes
  with one 400 Gb/s (50 GB/s) InfiniBand NDR port per GPU. NVIDIA H100 Tensor Core GPU datasheet.
- H200 SXM 141GB: the H100's compute (989.4 TFLOP/s), 4.8 TB/s HBM3e, NVLink 900 GB/s; 50 GB/s IB per GPU.
  NVIDIA H200 datasheet.
- H800 SXM5 80GB: the H100's compute and HBM (989.4 TFLOP/s, 3.35 TB/s), NVLink cut to 400 GB/s total (200 GB/s
  each way); 8 x 400 Gb/s IB per node (50 GB/s per GPU) as in the DeepSeek-V3 report's H800 cluster.
- A100 SXM4 80GB: 312 TFLOP/s bf16 dense, 2.039 TB/s HBM2e, NVLink 3 600 GB/s total (300 GB/s each way); one
  200 Gb/s (25 GB/s) HDR port per GPU. NVIDIA A100 datasheet.
- Host link: PCIe Gen5 x16 (H100/H200/H800) 64 GB/s each way, ~50 GB/s reached with pinned memory; Gen4 x16 (A100)
  32 GB/s, ~25 GB/s reached.
Device memory is what the driver reports (nvidia-smi: 81,559 MiB for the 80 GB Hopper parts, 143,771 MiB for the
H200, 81,920 MiB for the A100 80GB).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

TB, GB = 1e12, 1e9


@dataclass(frozen=True)
class Hardware:
    """One device type. Rates are per device; link bandwidths are one direction."""

    name: str
    peak_flops: float  # dense FLOP/s at the training/rollout precision (bf16 on GPUs)
    mem_bw: float  # device memory bandwidth, bytes/s
    intra_bw: float  # within a node (NVLink), bytes/s each way per device
    inter_bw: float  # between nodes (InfiniBand/RoCE), bytes/s each way per device
    host_bw: float  # device <-> host (PCIe), bytes/s each way, reached with pinned memory
    mem_gib: float  # device memory the driver reports
    gpus_per_node: int = 8
    mfu: float = 0.45  # share of peak FLOP/s a GEMM-bound phase reaches (assumption)
    mbu: float = 0.70  # share of memory bandwidth a bandwidth-bound phase reaches (assumption)
    collective_latency_s: float = 10e-6  # per collective (NCCL all-reduce of a small message over NVLink)
    layer_overhead_s: float = 0.0  # per decoder layer per forward call (kernel launches; 0: CUDA graphs)
    call_overhead_s: float = 0.0  # per forward call outside the layers (embedding, head, framework)
    decode_step_overhead_s: float = 0.0  # per generated token of the engine's loop (sampling, scheduling)
    decode_layer_overhead_s: float | None = None  # per layer per decode step (None: layer_overhead_s)
    shared_decode_layer_overhead_s: float | None = None  # the same with shared-prefix decoding (two-part attention)
    decode_bw: float | None = None  # bytes/s a decode step's weight reads reach (CPU: a skinny GEMM; None: mem_bw)
    bf16_decode_bw: float | None = None  # the same in bf16 where measured apart (None: decode_bw)
    vision_block_overhead_s: float = 0.0  # per vision-tower block per video run (window attention's small ops)
    overheads_occupy_compute: bool = False  # CPU: Python and kernels share the cores (no idle compute to hide in)
    fp32_flops: float | None = None  # CPU: fp32 matmul rate where it differs (the benchmarks run fp32)
    attention_flops: float | None = None  # CPU: achieved rate of the attention kernels (GPUs: the GEMM rate)
    fp32_attention_flops: float | None = None
    # CPU: the attention kernel's rate at one query per row (a decode step), where measured: PyTorch's CPU flash
    # kernel reaches ~37 GFLOP/s in fp32 but ~5 in bf16 there (GPUs: None, the attention rate)
    decode_attention_flops: float | None = None
    fp32_decode_attention_flops: float | None = None
    # CPU: the GEMM rate at other row counts relative to the reference one, "{precision}:{llm|vision}:{rows}" ->
    # ratio (calibrate.gemm_efficiency); None: one rate for every size (the GPU entries: mfu is an assumption)
    gemm_efficiency: dict[str, float] | None = None
    # CPU: the vision tower run whole vs its priced GEMMs, "{precision}:{forward|train}" -> measured / priced
    # seconds of its FLOPs (its convolution, attention backward and layout copies; planning/calibrate.py)
    vision_tower_factors: dict[str, float] | None = None
    source: str = ""

    def flops(self, precision: str = "bf16") -> float:
        """Achieved FLOP/s of a GEMM-bound phase at `precision`."""
        peak = self.fp32_flops if precision == "fp32" and self.fp32_flops else self.peak_flops
        return peak * self.mfu

    def attention_rate(self, precision: str = "bf16") -> float:
        """Achieved FLOP/s of the attention products (fused kernels), where measured apart from the GEMMs."""
        rate = self.fp32_attention_flops if precision == "fp32" else self.attention_flops
        return rate * self.mfu if rate else self.flops(precision)

    def decode_attention_rate(self, precision: str = "bf16") -> float:
        """Achieved FLOP/s of the attention products of a decode step (one query per row)."""
        rate = self.fp32_decode_attention_flops if precision == "fp32" else self.decode_attention_flops
        return rate * self.mfu if rate else self.attention_rate(precision)

    def vision_tower_factor(self, precision: str, train: bool) -> float:
        """How much longer the vision tower's FLOPs take than its GEMMs' rate says, run forward or trained
        (forward + backward), where measured; 1 elsewhere."""
        key = f"{precision}:{'train' if train else 'forward'}"
        return (self.vision_tower_factors or {}).get(key, 1.0)

    def gemm_factor(self, precision: str, tower: str, rows: float) -> float:
        """The share of `flops(precision)` a GEMM of `rows` rows reaches at `tower`'s shapes ("llm" or "vision"):
        interpolated in log(rows) between the measured sizes, held at the ends; 1 where nothing was measured."""
        prefix = f"{precision}:{tower}:"
        points = sorted((int(k[len(prefix):]), v) for k, v in (self.gemm_efficiency or {}).items()
                        if k.startswith(prefix))
        if not points or rows <= 0:
            return 1.0
        if rows <= points[0][0]:
            return points[0][1]
        for (r0, f0), (r1, f1) in zip(points, points[1:], strict=False):
            if rows <= r1:
                w = math.log(rows / r0) / math.log(r1 / r0)
                return f0 + w * (f1 - f0)
        return points[-1][1]

    def bandwidth(self) -> float:
        return self.mem_bw * self.mbu

    def decode_bandwidth(self, precision: str = "bf16") -> float:
        """Bytes/s of a decode step's weight and K/V reads at `precision`: GEMMs of a few rows stream their weights
        (on a CPU well below a copy's bandwidth, and bf16 ones at their own rate: measured apart)."""
        measured = (self.bf16_decode_bw if precision == "bf16" else None) or self.decode_bw
        return measured * self.mbu if measured else self.bandwidth()

    def decode_layer_cost_s(self, shared: bool) -> float:
        """Seconds per decoder layer per decode step outside the counted work (0 on GPUs: CUDA graphs)."""
        shared_cost = self.shared_decode_layer_overhead_s if shared else None
        plain = self.decode_layer_overhead_s if self.decode_layer_overhead_s is not None else self.layer_overhead_s
        return shared_cost if shared_cost is not None else plain

    def link_bw(self, group: int) -> float:
        """Bandwidth of a collective over `group` devices: NVLink within a node, the network beyond it."""
        return self.intra_bw if group <= self.gpus_per_node else self.inter_bw

    def to_json(self) -> dict:
        return asdict(self)


_HOPPER = dict(peak_flops=989.4 * TB, mem_bw=3.35 * TB, intra_bw=450 * GB, inter_bw=50 * GB, host_bw=50 * GB,
               mem_gib=81_559 / 1024)

GPUS: dict[str, Hardware] = {
    "H100": Hardware("H100", **_HOPPER,
                     source="H100 SXM5 80GB datasheet: 989 TFLOP/s bf16, 3.35 TB/s, NVLink 900 GB/s"),
    "H200": Hardware("H200", **{**_HOPPER, "mem_bw": 4.8 * TB, "mem_gib": 143_771 / 1024},
                     source="H200 SXM 141GB datasheet: 989 TFLOP/s bf16, 4.8 TB/s, NVLink 900 GB/s"),
    "H800": Hardware("H800", **{**_HOPPER, "intra_bw": 200 * GB},
                     source="H800 SXM5 80GB: H100 compute and HBM, NVLink 400 GB/s, 8 x 400 Gb/s IB per node"),
    "A100": Hardware("A100", peak_flops=312 * TB, mem_bw=2.039 * TB, intra_bw=300 * GB, inter_bw=25 * GB,
                     host_bw=25 * GB, mem_gib=80.0,
                     source="A100 SXM4 80GB datasheet: 312 TFLOP/s bf16, 2.04 TB/s, NVLink 600 GB/s"),
}


def resolve_hardware(name: str, **overrides: float) -> Hardware:
    """A table entry (case-insensitive) with any field overridden; "custom" starts from the H100's figures and
    expects the overrides (--peak-tflops, --mem-bw-tbs, ...)."""
    key = name.upper()
    if key == "CUSTOM":
        base = replace(GPUS["H100"], name="custom", source="custom: the H100's figures with the given overrides")
    elif key in GPUS:
        base = GPUS[key]
    else:
        raise ValueError(f"unknown GPU {name!r}: use one of {', '.join(GPUS)} or 'custom'")
    fields = {k: v for k, v in overrides.items() if v is not None}
    return replace(base, **fields) if fields else base

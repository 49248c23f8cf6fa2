"""The CPU-specific rates of the step model, priced by hand: the attention of a decode step at its own measured rate,
and the vision tower's measured cost beyond its GEMMs (tower factors); and the tower the calibration builds for
those factors is the one the FLOP model counts."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rollplex_trl.memory.model_dims import PRESETS, dims_from_config
from rollplex_trl.planning.calibrate import _vision_tower, cpu_hardware, vision_tower_factors
from rollplex_trl.planning.step_model import StepSpec, decode_bytes, forward_work, predict_step
from rollplex_trl.prefix.cost import attention_flops_per_pair, vision_flops_per_visual_token

RATES = {"fp32_flops": 1e11, "bf16_flops": 2e11, "fp32_attention_flops": 5e10, "bf16_attention_flops": 5e10,
         "mem_bw": 40e9, "decode_bw": 10e9, "call_overhead_s": 0.0, "layer_overhead_s": 0.0,
         "decode_step_overhead_s": 0.0, "decode_layer_overhead_s": 0.0, "shared_decode_layer_overhead_s": 0.0,
         "vision_block_overhead_s": 0.0}


def _small_dims():
    from transformers import AutoConfig

    from rollplex_trl.testing.checkpoints import get_checkpoint

    return dims_from_config(AutoConfig.from_pretrained(get_checkpoint("qwen2_5_vl", "small")), "small")


def test_decode_attention_is_priced_at_its_own_rate_by_hand():
    """A decode step's kernels run one after another: its GEMMs at max(FLOPs / GEMM rate, weights / decode
    bandwidth), its attention at max(FLOPs / decode-attention rate, K/V / decode bandwidth). PyTorch's CPU kernel
    at one query per row is slow in bf16 (~5 GFLOP/s here): at 1 GFLOP/s the attention's compute is what counts.
    Shared-prefix decoding's prompt part is a batched matmul: the GEMM rate. Without the rate measured (older
    calibrations, GPUs): the attention rate."""
    dims = PRESETS["Qwen2.5-VL-3B"]
    G, P, C = 8, 300, 16
    spec = StepSpec(num_gpus=1, train_tp=1, rollout_tp=1, batch=1, num_generations=G, prompt_len=P,
                    visual_tokens=0, completion_len=C, precision="fp32", weight_sync=False, max_num_seqs=64)
    pairs = G * (C * P + C * (C + 1) / 2)
    attention = pairs * attention_flops_per_pair(dims)
    for rates, shared, attention_rate in (({**RATES, "fp32_decode_attention_flops": 1e9}, False, 1e9),
                                          ({**RATES, "fp32_decode_attention_flops": 1e9}, True, 1e11),
                                          (RATES, False, 5e10)):
        decode = predict_step(dims, spec, cpu_hardware(rates), "rollplex" if shared else "trl").phase(
            "rollout_decode")
        weights, kv = decode_bytes(dims, spec, prompts=1, shared=shared)
        linear = decode.flops - decode.attention_flops
        assert decode.attention_flops == pytest.approx(attention)
        kernels = max(linear / 1e11, weights / 10e9) + max(attention / attention_rate, kv / 10e9)
        assert decode.seconds == pytest.approx(kernels + decode.elementwise_s + decode.link_s)
    # at 1 GFLOP/s the attention outweighs its K/V reads (~40x here): the step is slower than the bytes say
    slow = predict_step(dims, spec, cpu_hardware({**RATES, "fp32_decode_attention_flops": 1e9}), "trl")
    assert attention / 1e9 > 10 * decode_bytes(dims, spec, 1, False)[1] / 10e9
    assert slow.phase("rollout_decode").seconds > predict_step(dims, spec, cpu_hardware(RATES), "trl").phase(
        "rollout_decode").seconds


def test_vision_tower_factors_scale_the_towers_flops_forward_and_trained_by_hand():
    """With tower factors f (forward) and t (trained) the vision FLOPs of a forward phase take f times, those of
    the actor (forward + backward) t times the seconds the GEMM rate gives them; nothing else changes."""
    dims = PRESETS["Qwen2.5-VL-3B"]
    spec = StepSpec(num_gpus=1, train_tp=1, rollout_tp=1, batch=1, num_generations=4, prompt_len=400,
                    visual_tokens=256, completion_len=32, precision="fp32", weight_sync=False, micro_batch=4,
                    frame_patches=(32, 32))
    plain = predict_step(dims, spec, cpu_hardware(RATES), "trl")
    factors = {"fp32_vision_forward_factor": 2.0, "fp32_vision_train_factor": 3.0}
    scaled = predict_step(dims, spec, cpu_hardware({**RATES, **factors}), "trl")
    for phase, factor in (("rollout_prefill", 2.0), ("reference", 2.0), ("actor", 3.0)):
        a, b = plain.phase(phase), scaled.phase(phase)
        vision_s = a.vision_flops / (1e11 * a.vision_efficiency)
        assert vision_s > 0
        assert b.compute_s == pytest.approx(a.compute_s + (factor - 1) * vision_s)
    assert scaled.phase("rollout_decode").seconds == plain.phase("rollout_decode").seconds


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_the_calibrations_vision_tower_is_the_counted_one(preset):
    """The tower `vision_tower_factors` runs is built from the dims alone: it must have the checkpoint's parameters
    and the FLOPs the model counts (FlopCounterMode: GEMMs and the convolution; PyTorch's fused CPU attention is not
    counted, so the count is the tower's without its attention)."""
    from transformers import AutoConfig

    from rollplex_trl.testing.checkpoints import get_checkpoint

    dims = dims_from_config(AutoConfig.from_pretrained(get_checkpoint("qwen2_5_vl", preset)), preset)
    tower = _vision_tower(dims).eval()
    v = dims.vision
    assert sum(p.numel() for p in tower.parameters()) == v.num_params()
    grid = torch.tensor([[2, 12, 20]])
    pixels = torch.randn(int(grid.prod()), v.in_channels * v.temporal_patch * v.patch**2)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        tower(pixels, grid_thw=grid)
    counted = sum(counter.get_flop_counts()["Global"].values())
    assert counted == pytest.approx(vision_flops_per_visual_token(dims) * int(grid.prod()) / v.merge**2, rel=1e-9)


def test_the_vision_tower_factors_are_measured_for_qwen2_5_vl_towers_only():
    """Keys and signs (the values are this machine's speed); a Qwen3-VL tower has none (factor 1)."""
    rates = {**RATES, "fp32:vision:64": 0.5, "fp32:vision:1024": 1.0}
    out = vision_tower_factors(_small_dims(), rates, "fp32", repeats=1)
    assert set(out) == {"fp32_vision_forward_factor", "fp32_vision_train_factor"}
    assert all(math.isfinite(x) and x > 0 for x in out.values())
    assert vision_tower_factors(PRESETS["Qwen3-VL-2B"], rates, "fp32", repeats=1) == {}
    hw = cpu_hardware({**RATES, **out})
    assert hw.vision_tower_factor("fp32", True) == out["fp32_vision_train_factor"]
    assert hw.vision_tower_factor("bf16", True) == 1.0


def test_the_tower_attention_counts_in_the_step_models_vision_flops():
    """The step model's vision FLOPs per run include the attention over the spec's frame."""
    dims = PRESETS["Qwen2.5-VL-7B"]
    with_frame = forward_work(dims, 0, 0, 256, 0, (32, 32)).vision
    without = forward_work(dims, 0, 0, 256, 0).vision
    assert with_frame - without == pytest.approx(256 * 4 * 4 * dims.vision.hidden * (28 * 64 + 4 * 1024))

"""plan-run's step model (rollplex_trl/planning/) against references: the FLOPs it counts against PyTorch's FLOP
counter on the real modules of the tiny Qwen2.5-VL and against numbers computed by hand for one layer; the bytes
of decode against hand-computed values; the schedules against prefix/cost.py; the command's JSON for the paper's
setting, a 7B single-node H200 run and a setting that cannot fit. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rollplex_trl.memory.model_dims import PRESETS, dims_from_config
from rollplex_trl.planning.hardware import GPUS, resolve_hardware
from rollplex_trl.planning.step_model import (
    SCHEDULES,
    StepSpec,
    decode_bytes,
    decoder_weight_bytes,
    forward_work,
    predict_step,
)
from rollplex_trl.prefix.cost import (
    ScoringShape,
    attention_flops_per_pair,
    linear_flops_per_token,
    serial_flops,
    shared_flops,
    vision_flops_per_visual_token,
)

_LINEAR = ("aten.mm", "aten.addmm")
_PRODUCTS = ("aten.bmm", "aten.matmul")


@pytest.fixture(scope="module")
def tiny_vl():
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex_trl.testing.checkpoints import get_checkpoint

    path = get_checkpoint("qwen2_5_vl", "tiny")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, attn_implementation="eager").eval()
    return model, dims_from_config(model.config, "tiny")


def _module_counts(fn) -> dict[str, dict[str, float]]:
    with FlopCounterMode(display=False) as counter:
        fn()
    return {mod: {str(op): float(n) for op, n in ops.items()} for mod, ops in counter.get_flop_counts().items()}


def _layer_key(counts: dict, suffix: str) -> str:
    keys = [k for k in counts if k.endswith(suffix)]
    assert keys, f"no module ending in {suffix!r} among {sorted(counts)[:20]}"
    return min(keys, key=len)


def test_tiny_dims_are_the_ones_computed_by_hand(tiny_vl):
    _, dims = tiny_vl
    assert (dims.hidden, dims.heads, dims.kv_heads, dims.head_dim, dims.intermediate) == (64, 4, 2, 16, 128)
    # one layer: q 64x64, k and v 64x32 each, o 64x64, gate/up/down 3 x 64x128 = 36,864 weights, 2 FLOPs each
    assert linear_flops_per_token(dims) / dims.layers == 73_728
    assert attention_flops_per_pair(dims) / dims.layers == 4 * 4 * 16  # q.k and p.v per head
    v = dims.vision
    assert (v.hidden, v.intermediate) == (32, 64)
    # one block per patch: qkv + proj 4 x 32x32, gate/up/down 3 x 32x64 = 10,240 weights; the patch embedding
    # 3 x 2 x 14 x 14 x 32 = 37,632; the merger (128 -> 128 -> 64) per merged token 24,576 = 6,144 per patch;
    # 2 FLOPs per weight, x merge^2 patches per merged token
    assert vision_flops_per_visual_token(dims) == 2 * (v.depth * 10_240 + 37_632 + 6_144) * 4
    # attention over 4 x 6 patch frames: one full block (24 keys), one window block (the 112-pixel window holds
    # the whole frame: 24 keys); 2 x hidden FLOPs per (query, key) for q.k and as many for p.v
    assert (vision_flops_per_visual_token(dims, (4, 6)) - vision_flops_per_visual_token(dims)
            == 4 * 32 * 48 * 4)


def test_one_decoder_layer_matches_the_flop_counter_and_the_hand_count(tiny_vl):
    """Decoder layer 0 of the real model on N tokens (eager attention): its projections and MLP are exactly the
    modelled linear FLOPs, its two attention products the full N x N square (eager; the model counts the causal
    half, what the fused kernels compute)."""
    model, dims = tiny_vl
    n = 23
    ids = torch.randint(10, 500, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        counts = _module_counts(lambda: model(input_ids=ids))
    layer = counts[_layer_key(counts, "layers.0")]
    linear = sum(layer.get(op, 0.0) for op in _LINEAR)
    products = sum(layer.get(op, 0.0) for op in _PRODUCTS)
    work = forward_work(dims, n, n * n / 2, 0.0, 0.0)
    assert linear == work.linear / dims.layers == n * 73_728
    assert products == 2 * work.attention / dims.layers == n * n * 256


def test_one_vision_block_matches_the_flop_counter_and_the_hand_count(tiny_vl):
    model, dims = tiny_vl
    v = dims.vision
    grid = torch.tensor([[2, 4, 6]])
    patches = int(grid.prod())
    pixels = torch.randn(patches, v.in_channels * v.temporal_patch * v.patch * v.patch)
    with torch.no_grad():
        counts = _module_counts(lambda: model.model.visual(pixels, grid_thw=grid))
    block = counts[_layer_key(counts, "blocks.0")]
    linear = sum(block.get(op, 0.0) for op in _LINEAR)
    visual_tokens = patches / v.merge**2
    assert linear == patches * 2 * 10_240
    embed_and_merger = 2 * patches * (37_632 + 6_144)
    assert linear * v.depth + embed_and_merger == forward_work(dims, 0, 0, visual_tokens, 0).vision


def test_the_schedules_count_what_prefix_cost_counts():
    """The scoring passes of the TRL and Rollplex schedules are prefix/cost.py's serial and shared FLOPs (the
    model `auto` decides from): the reference pass of TRL's schedule is serial_flops; Rollplex's prefix job plus
    its suffix pass is shared_flops with the cascade suffix. The step model also counts the vision tower's
    attention over its frames (prefix/cost.py's decision leaves it out: it scales with the tower runs alike): G
    runs' worth in TRL's pass, one in the shared one."""
    dims = PRESETS["Qwen2.5-VL-7B"]
    spec = StepSpec(num_gpus=1, train_tp=1, rollout_tp=1, batch=1, num_generations=8, prompt_len=2000,
                    visual_tokens=1800, completion_len=300)
    shape = ScoringShape(2000, 300, 8, 1800)
    tower_attention = 1800 * (vision_flops_per_visual_token(dims, spec.frame_patches)
                              - vision_flops_per_visual_token(dims))
    assert tower_attention > 0
    trl = predict_step(dims, spec, GPUS["H100"], "trl")
    serial = serial_flops(dims, shape).total + 8 * tower_attention
    assert trl.phase("reference").flops == pytest.approx(serial, rel=1e-12)
    rp = predict_step(dims, spec, GPUS["H100"], "rollplex")
    shared = rp.phase("ref_prefix").flops + rp.phase("reference").flops
    assert shared == pytest.approx(shared_flops(dims, shape, "cascade").total + tower_attention, rel=1e-12)
    # the actor: forward + backward (2x) + recompute (1x) = 4 forwards of the same passes
    assert trl.phase("actor").flops == pytest.approx(4 * serial, rel=1e-12)


def test_decode_bytes_are_weights_and_kv_per_token_by_hand():
    """Qwen2.5-VL-7B, one rollout rank, bf16: K/V per token = 2 x 28 layers x 4 KV heads x 128 x 2 B = 57,344 B;
    each of C = 10 steps reads the decoder's weights and LM head once and every earlier token's K/V."""
    dims = PRESETS["Qwen2.5-VL-7B"]
    assert dims.kv_bytes_per_token(1, 2) == 57_344
    G, P, C = 8, 1000, 10
    spec = StepSpec(num_gpus=1, train_tp=1, rollout_tp=1, batch=1, num_generations=G, prompt_len=P,
                    completion_len=C)
    weights = (28 * dims.layer_params(1) + 152_064 * 3584) * 2
    assert decoder_weight_bytes(dims, 1, 2) == weights
    w, kv = decode_bytes(dims, spec, prompts=1, shared=False)
    assert w == C * weights
    assert kv == (G * C * P + G * C * (C + 1) / 2) * 57_344  # every sample reads its own copy of the prompt
    w2, kv_shared = decode_bytes(dims, spec, prompts=1, shared=True)
    assert w2 == w and kv_shared == (C * P + G * C * (C + 1) / 2) * 57_344  # the prompt once per prompt
    # at TP 4 each rank holds one KV head of 4: a quarter of the K/V, and its share of the weights
    spec4 = StepSpec(num_gpus=4, train_tp=4, rollout_tp=4, batch=1, num_generations=G, prompt_len=P,
                     completion_len=C)
    assert decode_bytes(dims, spec4, 1, False)[1] == kv / 4
    # priced by memory traffic on an H200: bytes / (4.8 TB/s x 0.7)
    pred = predict_step(dims, spec, GPUS["H200"], "trl").phase("rollout_decode")
    assert pred.mem_bytes == w + kv
    assert pred.memory_s == pytest.approx((w + kv) / (4.8e12 * 0.7))
    assert pred.bound == "memory"


def test_cpu_decode_is_priced_at_the_skinny_gemm_bandwidth_plus_its_per_layer_costs_by_hand():
    """The calibrated CPU entry: a decode step reads its bytes at `decode_bw` (a few-row GEMM's weight rate, not a
    copy's), and pays the loop's per-step cost plus, per layer, the plain or the shared-prefix attention's cost;
    the prefill (a forward call, not a decode step) keeps the copy bandwidth and the per-call and per-layer costs."""
    from rollplex_trl.planning.calibrate import cpu_hardware

    dims = PRESETS["Qwen2.5-VL-3B"]
    rates = {"fp32_flops": 1e15, "bf16_flops": 1e15, "fp32_attention_flops": 1e15, "bf16_attention_flops": 1e15,
             "mem_bw": 40e9, "decode_bw": 10e9, "call_overhead_s": 4e-4, "layer_overhead_s": 5e-4,
             "decode_step_overhead_s": 2e-3, "decode_layer_overhead_s": 6e-4,
             "shared_decode_layer_overhead_s": 1e-3, "vision_block_overhead_s": 0.0}
    hw = cpu_hardware(rates)
    G, P, C = 8, 300, 16
    spec = StepSpec(num_gpus=1, train_tp=1, rollout_tp=1, batch=1, num_generations=G, prompt_len=P,
                    visual_tokens=0, completion_len=C, precision="fp32", weight_sync=False, max_num_seqs=64)
    L = dims.layers
    for schedule, shared, per_layer in (("trl", False, 6e-4), ("rollplex", True, 1e-3)):
        decode = predict_step(dims, spec, hw, schedule).phase("rollout_decode")
        w, kv = decode_bytes(dims, spec, prompts=1, shared=shared)
        assert decode.memory_s == pytest.approx((w + kv) / 10e9)
        assert decode.overhead_s == pytest.approx(C * (2e-3 + L * per_layer))
        assert decode.bound == "memory"  # 3B's weights at 10 GB/s: ~0.6 s per step, far above the overheads
    prefill = predict_step(dims, spec, hw, "trl").phase("rollout_prefill")
    assert prefill.memory_s == pytest.approx(decoder_weight_bytes(dims, 1, 4) / 40e9)
    assert prefill.overhead_s == pytest.approx(4e-4 + L * 5e-4)
    # two ranks (Megatron t = 2 on a CPU): each of a decode step's 2 all-reduces per layer pays the measured latency
    spec2 = StepSpec(num_gpus=2, train_tp=2, rollout_tp=2, batch=1, num_generations=G, prompt_len=P,
                     visual_tokens=0, completion_len=C, precision="fp32", weight_sync=False, max_num_seqs=64)
    hw2 = cpu_hardware({**rates, "collective_latency_s": 7e-4}, threads_share=0.5)
    decode2 = predict_step(dims, spec2, hw2, "trl").phase("rollout_decode")
    assert decode2.link_s == pytest.approx(decode2.link_bytes / 20e9 + 2 * L * C * 7e-4)
    # a calibration from before the decode loop was measured apart: a step costs a call plus the loop's own
    old = {k: v for k, v in rates.items() if k not in ("decode_bw", "decode_layer_overhead_s",
                                                       "shared_decode_layer_overhead_s")}
    decode = predict_step(dims, spec, cpu_hardware(old), "trl").phase("rollout_decode")
    assert decode.overhead_s == pytest.approx(C * (2e-3 + 4e-4 + L * 5e-4))
    assert decode.memory_s == pytest.approx(sum(decode_bytes(dims, spec, 1, False)) / 40e9)
    # bf16: its own skinny-GEMM rate where measured (bf16 weights and K/V: half the bytes), else the fp32 one
    bf16 = StepSpec(**{**spec.__dict__, "precision": "bf16"})
    for extra, rate in (({"bf16_decode_bw": 4e9}, 4e9), ({}, 10e9)):
        decode = predict_step(dims, bf16, cpu_hardware({**rates, **extra}), "trl").phase("rollout_decode")
        assert decode.memory_s == pytest.approx(sum(decode_bytes(dims, bf16, 1, False)) / rate)
    assert sum(decode_bytes(dims, bf16, 1, False)) == sum(decode_bytes(dims, spec, 1, False)) / 2


def test_cpu_gemms_are_priced_at_the_efficiency_of_their_own_size_by_hand():
    """A calibrated CPU's GEMM rate at other row counts (`gemm_efficiency`, relative to 1024 rows): interpolated in
    log(rows), held at the ends; each phase's linear FLOPs are priced at its tokens per forward call and its vision
    FLOPs at its patches per call; a phase of two sizes (the actor's suffixes and its prefix's backward) at the
    FLOP-weighted harmonic mean. The GPU entries have no curve: one rate."""
    import math

    from rollplex_trl.planning.calibrate import cpu_hardware

    curve = {"fp32:llm:64": 0.5, "fp32:llm:256": 0.9, "fp32:llm:1024": 1.0,
             "fp32:vision:64": 0.25, "fp32:vision:256": 0.5, "fp32:vision:1024": 0.8}
    rates = {"fp32_flops": 1e11, "bf16_flops": 1e11, "fp32_attention_flops": 5e10, "bf16_attention_flops": 5e10,
             "mem_bw": 1e15, "decode_bw": 1e15, "call_overhead_s": 0.0, "layer_overhead_s": 0.0,
             "decode_step_overhead_s": 0.0, "decode_layer_overhead_s": 0.0, "shared_decode_layer_overhead_s": 0.0,
             "vision_block_overhead_s": 0.0, **curve}
    hw = cpu_hardware(rates)
    assert hw.gemm_factor("fp32", "llm", 128) == pytest.approx(0.5 + 0.4 * 0.5)  # halfway in log(rows)
    assert hw.gemm_factor("fp32", "llm", 16) == 0.5 and hw.gemm_factor("fp32", "llm", 5000) == 1.0
    assert hw.gemm_factor("fp32", "vision", 512) == pytest.approx(0.5 + 0.3 * 0.5)
    assert hw.gemm_factor("bf16", "llm", 64) == 1.0  # nothing measured at bf16: one rate
    assert GPUS["H100"].gemm_factor("bf16", "llm", 64) == 1.0

    dims = PRESETS["Qwen2.5-VL-3B"]
    G, P, V, C = 4, 129, 32, 16  # the prefix job: 128 tokens per call; its clip: 32 x 4 = 128 patches
    spec = StepSpec(num_gpus=1, train_tp=1, rollout_tp=1, batch=1, num_generations=G, prompt_len=P,
                    visual_tokens=V, completion_len=C, precision="fp32", weight_sync=False, micro_batch=G,
                    reference=False, recompute=False)
    pred = predict_step(dims, spec, hw, "rollplex")
    job = pred.phase("actor_prefix")
    f_llm = 0.5 + 0.4 * math.log(128 / 64) / math.log(4)
    f_vis = 0.25 + 0.25 * math.log(128 / 64) / math.log(4)
    linear = job.flops - job.attention_flops - job.vision_flops
    assert job.compute_s == pytest.approx(linear / (1e11 * f_llm) + job.attention_flops / 5e10
                                          + job.vision_flops / (1e11 * f_vis))
    # the actor: its G suffixes of 1 + C tokens in one call (68 rows), forward + backward (3 forwards), plus the
    # prefix's backward (2 forwards at 128 rows, the clip's backward at 128 patches)
    actor = pred.phase("actor")
    suffix = forward_work(dims, G * (1 + C), G * ((1 + C) * (P - 1) + (1 + C) ** 2 / 2), 0.0, G * C) * 3
    prefix = forward_work(dims, P - 1, (P - 1) ** 2 / 2, V, 0.0, spec.frame_patches) * 2
    f_suffix = 0.5 + 0.4 * math.log(68 / 64) / math.log(4)
    expected = ((suffix.linear / f_suffix + prefix.linear / f_llm) / 1e11 + (suffix + prefix).attention / 5e10
                + prefix.vision / (1e11 * f_vis))
    assert actor.compute_s == pytest.approx(expected)
    # the same step on a device without a curve prices every GEMM at the one rate
    flat = predict_step(dims, spec, cpu_hardware({k: v for k, v in rates.items() if k not in curve}), "rollplex")
    assert flat.phase("actor").compute_s == pytest.approx(
        (suffix + prefix).linear / 1e11 + (suffix + prefix).attention / 5e10 + prefix.vision / 1e11)


def test_rollplex_is_faster_and_each_mechanism_only_removes_work():
    dims = PRESETS["Qwen2.5-VL-32B"]
    spec = StepSpec()
    preds = {name: predict_step(dims, spec, GPUS["H800"], name) for name in SCHEDULES}
    assert preds["rollplex"].step_s < preds["serial"].step_s <= preds["trl"].step_s
    assert preds["serial"].phase("rollout_prefill").flops < preds["trl"].phase("rollout_prefill").flops
    assert preds["rollplex"].phase("rollout_decode").mem_bytes < preds["serial"].phase("rollout_decode").mem_bytes
    assert preds["rollplex"].phase("weight_sync").seconds < preds["serial"].phase("weight_sync").seconds


def test_custom_hardware_overrides_and_unknown_names():
    hw = resolve_hardware("custom", peak_flops=500e12, mem_bw=2e12)
    assert hw.peak_flops == 500e12 and hw.mem_bw == 2e12 and hw.intra_bw == GPUS["H100"].intra_bw
    with pytest.raises(ValueError, match="unknown GPU"):
        resolve_hardware("B300")


def _plan_json(capsys, *argv: str) -> dict:
    from rollplex_trl.cli import main

    assert main(["plan-run", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_run_answers_the_paper_setting(capsys):
    out = _plan_json(capsys, "--example", "paper")
    assert out["model"]["name"] == "Qwen2.5-VL-32B" and out["hardware"]["name"] == "H800"
    assert (out["spec"]["num_gpus"], out["spec"]["train_tp"], out["spec"]["rollout_tp"]) == (32, 8, 4)
    steps = {name: s["step_s"] for name, s in out["schedules"].items()}
    assert steps["rollplex"] < steps["serial"] <= steps["trl"]
    assert out["speedup"]["rollplex_vs_serial"] == pytest.approx(steps["serial"] / steps["rollplex"], rel=1e-3)
    assert out["fits"]["rollplex"] and not out["overflows"]
    names = [p["name"] for p in out["schedules"]["rollplex"]["phases"]]
    for phase in ("rollout_prefill", "rollout_decode", "ref_prefix", "reference", "actor", "optimizer",
                  "weight_sync"):
        assert phase in names
    for p in out["schedules"]["rollplex"]["phases"]:
        assert p["seconds"] >= 0 and 0 < p["memory_gib"] < 79.7
    cmp = out["paper_comparison"]
    assert cmp["paper_speedup_vs_serial"] == [1.23, 1.30] and cmp["predicted_speedup_vs_serial"] > 1
    assert cmp["assumptions"] and out["assumptions"]
    # plan-memory's prediction is reused, not re-derived: Rollplex's peak is its 34.7 GiB
    assert out["schedules"]["rollplex"]["memory"]["peak_gib"] == pytest.approx(34.7, abs=0.1)


def test_plan_run_answers_a_7b_single_node_h200_run(capsys, tmp_path):
    out = _plan_json(capsys, "--example", "7b-h200", "--gantt", str(tmp_path / "step.png"))
    assert out["model"]["name"] == "Qwen2.5-VL-7B" and out["hardware"]["name"] == "H200"
    assert out["spec"]["num_gpus"] == 8 and out["paper_comparison"] is None
    assert all(out["fits"].values())
    assert out["schedules"]["rollplex"]["step_s"] < out["schedules"]["trl"]["step_s"]
    if out["gantt"]:  # matplotlib installed
        assert (tmp_path / "step.png").stat().st_size > 1000


def test_plan_run_prices_the_vision_towers_attention_over_the_frame_size(capsys):
    """--frame-size sets the frame the vision tower attends over: 16 frames of 112 x 112 (8 x 8 patches) or
    448 x 448 (32 x 32). Per visual token the tower's FLOPs differ by its attention alone (the full-attention
    blocks attend over 16x the keys), as the FLOP model of the tower says."""
    from rollplex_trl.planning.cli import frame_patches

    assert frame_patches("448x448") == (32, 32) and frame_patches("224x112") == (8, 16)
    for bad in ("448", "448x", "axb", "0x448"):
        with pytest.raises(ValueError, match="--frame-size must be WIDTHxHEIGHT"):
            frame_patches(bad)
    dims = PRESETS["Qwen2.5-VL-7B"]
    flops = {}
    for size in ("112x112", "448x448"):
        out = _plan_json(capsys, "--example", "7b-h200", "--frames", "16", "--frame-size", size)
        prefill = next(p for p in out["schedules"]["trl"]["phases"] if p["name"] == "rollout_prefill")
        assert out["spec"]["frame_patches"] == list(frame_patches(size))
        flops[size] = prefill["vision_flops"] / out["spec"]["visual_tokens"]
    assert flops["448x448"] / flops["112x112"] == pytest.approx(
        vision_flops_per_visual_token(dims, (32, 32)) / vision_flops_per_visual_token(dims, (8, 8)), rel=1e-9)
    assert flops["448x448"] > flops["112x112"]


def test_plan_run_says_what_does_not_fit_and_the_cheapest_setting_that_does(capsys):
    """Qwen2.5-VL-32B on 8 GPUs at TP 1 without weight sharing or offload: 33 B parameters' bf16 weights, fp32
    gradients and optimizer state on one GPU cannot fit; the answer names the phase and the tensor class."""
    out = _plan_json(capsys, "--model", "Qwen2.5-VL-32B", "--gpu", "H100", "--num-gpus", "8", "--train-tp", "1",
                     "--rollout-tp", "1", "--batch", "8", "--no-offload", "--no-weight-sharing")
    assert not out["fits"]["rollplex"]
    over = [o for o in out["overflows"] if o["schedule"] == "rollplex"]
    assert {o["phase"] for o in over} >= {"train", "optimizer"}
    train = next(o for o in over if o["phase"] == "train")
    assert train["gib"] > train["limit_gib"] and train["tensor_class"] and train["component"]
    assert "does not fit in train" in train["message"]
    suggestion = out["suggestion"]
    assert suggestion is not None and suggestion["peak_gib"] <= 79.7
    assert "TP" in suggestion["change"] or "offload" in suggestion["change"] or "GPUs" in suggestion["change"]


def test_the_calibration_runs_rollplex_decode_path_and_reports_every_rate():
    """The calibration measures through Rollplex's own rollout (generate_with_shared_prefill, shared decoding on
    and off) on the tiny Qwen2.5-VL: it must keep running as that code changes. Only the presence and sign of
    each rate are asserted (their values are this machine's speed)."""
    import math

    from rollplex_trl.planning.calibrate import decode_bandwidth, decode_overheads

    out = decode_overheads(repeats=1, tokens=3)
    assert set(out) == {"decode_step_overhead_s", "decode_layer_overhead_s", "shared_decode_layer_overhead_s"}
    assert all(math.isfinite(v) and v >= 0 for v in out.values())
    assert decode_bandwidth(PRESETS["Qwen2.5-VL-3B"], repeats=1) > 0


def test_the_gemm_efficiency_calibration_reports_every_size_of_both_towers(tiny_vl):
    """Keys and signs only (the values are this machine's speed): one ratio per size per tower, the reference
    size exactly 1."""
    import math

    from rollplex_trl.planning.calibrate import GEMM_TOKENS, gemm_efficiency

    _, dims = tiny_vl
    out = gemm_efficiency(dims, "fp32", repeats=1)
    assert set(out) == {f"fp32:{tower}:{rows}" for tower in ("llm", "vision") for rows in GEMM_TOKENS}
    assert out["fp32:llm:1024"] == 1.0
    assert all(math.isfinite(v) and v > 0 for v in out.values())

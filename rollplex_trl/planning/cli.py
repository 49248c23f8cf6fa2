"""`rollplex-trl plan-run`: one step's time and memory per phase for TRL, serial colocation and Rollplex, before
any GPU is booked (docs/planning.md)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from rollplex_trl.memory.planner import GIB
from rollplex_trl.planning.hardware import GPUS, resolve_hardware
from rollplex_trl.planning.plan import PAPER_SPEEDUP, RunPlan, RunSettings, host_state_gib, plan_run
from rollplex_trl.planning.step_model import ELEMENTWISE_PASSES, StepSpec

# the worked examples of issue 37 (`--example`); flags given explicitly override them
EXAMPLES = {
    "paper": dict(model="Qwen2.5-VL-32B", gpu="H800", num_gpus=32, train_tp=8, rollout_tp=4, batch=32,
                  num_generations=8, prompt_len=3072, completion_len=768),
    "7b-h200": dict(model="Qwen2.5-VL-7B", gpu="H200", num_gpus=8, train_tp=4, rollout_tp=2, batch=16,
                    num_generations=8, prompt_len=3072, completion_len=768),
}
_DEFAULTS = EXAMPLES["paper"]
TEXT_TOKENS = 64  # the instruction's tokens besides the video's, when the prompt is given as frames
PHASE_ORDER = ("rollout_prefill", "rollout_decode", "ref_prefix", "old_prefix", "actor_prefix", "reference", "old",
               "actor", "optimizer", "weight_sync")


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan-run", help="predicted time and memory per phase of one GRPO step: TRL, serial colocation, Rollplex",
        description="Model one GRPO step per phase (rollout prefill and decode, reference, old and actor passes, "
                    "optimizer, weight sync): seconds from FLOPs and bytes on the chosen GPU, memory per GPU from "
                    "plan-memory's lifetimes, for TRL's schedule, serial colocation and Rollplex. Every assumption "
                    "is printed.")
    p.add_argument("--example", choices=sorted(EXAMPLES),
                   help="paper: Qwen2.5-VL-32B on 32 H800, TP 8 / 4 (the paper's setting); 7b-h200: Qwen2.5-VL-7B "
                        "on one 8 x H200 node")
    p.add_argument("--model", help="preset (Qwen2.5-VL-3B/7B/32B/72B, ...) or an HF config.json "
                                   f"(default {_DEFAULTS['model']})")
    p.add_argument("--gpu", help=f"{', '.join(GPUS)} or custom (default {_DEFAULTS['gpu']})")
    p.add_argument("--num-gpus", type=int)
    p.add_argument("--train-tp", type=int, help="training tensor-parallel degree t")
    p.add_argument("--rollout-tp", type=int, help="rollout (vLLM) tensor-parallel degree r")
    p.add_argument("--batch", type=int, help="B: prompts per optimizer step, GLOBAL (over all GPUs)")
    p.add_argument("--num-generations", type=int, help="G: completions per prompt")
    p.add_argument("--prompt-len", type=int, help="P: prompt tokens, video included (90%% video assumed)")
    p.add_argument("--frames", type=int, help="frames per video (instead of --prompt-len)")
    p.add_argument("--frame-size", default="448x448",
                   help="WxH of a frame after resizing: with --frames its visual tokens; always the span of the "
                        "vision tower's attention")
    p.add_argument("--completion-len", type=int, help="C: completion tokens")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--no-reference", action="store_true", help="KL beta = 0: no reference pass or weights")
    p.add_argument("--old-pass", action="store_true", help="old-policy log-probs (num_iterations > 1)")
    p.add_argument("--no-recompute", action="store_true", help="no activation recompute in the actor's backward")
    p.add_argument("--no-offload", action="store_true",
                   help="keep the optimizer state, reference and weights resident (no host offload or streaming)")
    p.add_argument("--no-weight-sharing", action="store_true", help="Rollplex without shared rollout weights")
    p.add_argument("--incompatible-fraction", type=float, default=0.072,
                   help="rollout parameters rebuilt each sync with weight sharing (plan-sharding: ~0.07 at 8 -> 4)")
    hw = p.add_argument_group("device figures (override the table; --gpu custom starts from the H100's)")
    hw.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s")
    hw.add_argument("--mem-bw-tbs", type=float, help="device memory bandwidth, TB/s")
    hw.add_argument("--nvlink-gbs", type=float, help="NVLink GB/s each way per GPU")
    hw.add_argument("--network-gbs", type=float, help="inter-node GB/s each way per GPU")
    hw.add_argument("--mem-gib", type=float, help="device memory, GiB")
    hw.add_argument("--mfu", type=float, help="achieved share of peak FLOP/s (default 0.45)")
    hw.add_argument("--mbu", type=float, help="achieved share of memory bandwidth (default 0.70)")
    p.add_argument("--video-source", metavar="WxH",
                   help="a typical source clip: also print the video data's host memory (as plan-memory)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--gantt", metavar="FILE.png", help="draw the predicted step (needs matplotlib)")
    p.set_defaults(func=run)
    return p


def _settings(args: argparse.Namespace) -> dict:
    base = dict(EXAMPLES[args.example] if args.example else _DEFAULTS)
    for key in base:
        value = getattr(args, key, None)
        if value is not None:
            base[key] = value
    return base


def frame_size(size: str) -> tuple[int, int]:
    """(width, height) in pixels from "WxH" (--frame-size), or a ValueError saying what is expected."""
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--frame-size must be WIDTHxHEIGHT in pixels, e.g. 448x448; got {size!r}")
    return int(parts[0]), int(parts[1])


def visual_tokens(frames: int, size: str, temporal_patch: int = 2, unit: int = 28) -> int:
    """Merged visual tokens of `frames` frames of `size` (WxH, rounded down to 28-pixel units)."""
    w, h = frame_size(size)
    return math.ceil(frames / temporal_patch) * max(1, w // unit) * max(1, h // unit)


def frame_patches(size: str, unit: int = 28, merge: int = 2) -> tuple[int, int]:
    """One frame's height x width in patches (`size` WxH rounded down to `unit`-pixel merged tokens, as
    `visual_tokens` counts them): what the vision tower's attention spans."""
    w, h = frame_size(size)
    return max(1, h // unit) * merge, max(1, w // unit) * merge


def build(args: argparse.Namespace) -> tuple[RunPlan, dict]:
    from rollplex_trl.memory.model_dims import resolve_model

    s = _settings(args)
    model = resolve_model(s["model"])
    if args.frames:
        temporal = model.vision.temporal_patch if model.vision else 2
        unit = model.vision.patch * model.vision.merge if model.vision else 28
        v = visual_tokens(args.frames, args.frame_size, temporal, unit)
        prompt = v + TEXT_TOKENS
    else:
        prompt = s["prompt_len"]
        v = 0.9 * prompt if model.vision else 0.0
    unit = model.vision.patch * model.vision.merge if model.vision else 28
    frame = frame_patches(args.frame_size, unit, model.vision.merge if model.vision else 2)
    hw = resolve_hardware(s["gpu"], peak_flops=_scaled(args.peak_tflops, 1e12), mem_bw=_scaled(args.mem_bw_tbs, 1e12),
                          intra_bw=_scaled(args.nvlink_gbs, 1e9), inter_bw=_scaled(args.network_gbs, 1e9),
                          mem_gib=args.mem_gib, mfu=args.mfu, mbu=args.mbu)
    spec = StepSpec(num_gpus=s["num_gpus"], train_tp=s["train_tp"], rollout_tp=s["rollout_tp"], batch=s["batch"],
                    num_generations=s["num_generations"], prompt_len=int(prompt), visual_tokens=float(v),
                    completion_len=s["completion_len"], frame_patches=frame, precision=args.precision,
                    micro_batch=args.micro_batch,
                    reference=not args.no_reference, old_pass=args.old_pass, recompute=not args.no_recompute,
                    incompatible_fraction=args.incompatible_fraction)
    settings = RunSettings(offload=not args.no_offload, weight_sharing=not args.no_weight_sharing)
    return plan_run(model, spec, hw, settings, frames=args.frames), s


def _scaled(value: float | None, unit: float) -> float | None:
    return None if value is None else value * unit


def is_paper_setting(plan: RunPlan) -> bool:
    s = plan.spec
    return (plan.model.name == "Qwen2.5-VL-32B" and plan.hardware.name == "H800" and s.num_gpus == 32
            and s.train_tp == 8 and s.rollout_tp == 4)


def paper_comparison(plan: RunPlan) -> dict | None:
    if not is_paper_setting(plan):
        return None
    return {"paper_speedup_vs_serial": list(PAPER_SPEEDUP), "predicted_speedup_vs_serial": plan.speedup_vs_serial,
            "assumptions": paper_assumptions(plan)}


def paper_assumptions(plan: RunPlan) -> list[str]:
    s = plan.spec
    return [
        f"B = {s.batch} prompts per step over {s.num_gpus} GPUs, G = {s.num_generations}, P = {s.prompt_len} "
        f"tokens ({s.visual_tokens / s.prompt_len:.0%} video), C = {s.completion_len}: plan-memory's reading of the "
        "paper's setup; the paper's own batch and lengths are not known here.",
        "Serial colocation = the paper's baseline as this model understands it: vLLM prefills each prompt once "
        "(n-sampling / prefix caching), every training pass runs the G full sequences, phases in turn, training "
        "state offloaded around the rollout, the rollout weights rebuilt in full.",
        f"Rates: {plan.hardware.mfu:.0%} of the dense bf16 peak for GEMM phases, {plan.hardware.mbu:.0%} of HBM "
        "bandwidth for decode, TP collectives not overlapped with compute.",
        "The prediction counts the shared prefix in scoring and training, which removes (G - 1) / G of the prompt's "
        "work; the ablation shows the step with each mechanism added in turn.",
    ]


def run(args: argparse.Namespace) -> int:
    try:
        plan, settings = build(args)
    except ValueError as exc:
        print(f"plan-run: {exc}", file=sys.stderr)
        return 2
    host = _host_video(args, plan)
    gantt = None
    if args.gantt:
        from rollplex_trl.planning.gantt import write_gantt

        gantt = write_gantt(plan.predictions, args.gantt, f"Predicted step: {plan.model.name}, {plan.spec.num_gpus} x "
                                                          f"{plan.hardware.name}, TP {plan.spec.train_tp} / "
                                                          f"{plan.spec.rollout_tp}")
    if args.json:
        out = plan.to_json()
        out["paper_comparison"] = paper_comparison(plan)
        out["assumptions"] = assumptions(plan)
        out["host_video"] = host[0] if host else None
        out["gantt"] = str(gantt) if gantt else None
        print(json.dumps(out, indent=2, default=float))
    else:
        print(format_plan(plan))
        if host:
            print("\n" + host[1])
        if gantt:
            print(f"\nGantt chart written to {gantt}")
    return 0


def _host_video(args: argparse.Namespace, plan: RunPlan) -> tuple[dict, str] | None:
    """The video data's host memory (memory/host.py, as `plan-memory --video-source`), or None."""
    if not args.video_source:
        return None
    from rollplex_trl.data.video import VideoSamplingConfig
    from rollplex_trl.memory.host import SourceClip, format_host_plan, plan_host_media

    width, height = (int(x) for x in args.video_source.lower().split("x"))
    clip = SourceClip(height=height, width=width, fps=30.0, seconds=60.0)
    sampling = VideoSamplingConfig(max_frames=args.frames) if args.frames else VideoSamplingConfig()
    batch_rows = -(-plan.spec.batch // plan.spec.train_dp)
    host = plan_host_media(clip, sampling, cache_rows=64, workers=1, batch_rows=batch_rows, keep_frames=True)
    return ({"frames": host.frames, **dict(host.rows())}, format_host_plan(host, clip))


def assumptions(plan: RunPlan) -> list[str]:
    hw, s = plan.hardware, plan.spec
    return [
        f"Device {hw.name}: {hw.peak_flops / 1e12:.0f} TFLOP/s dense bf16 x mfu {hw.mfu:.2f}, memory "
        f"{hw.mem_bw / 1e12:.2f} TB/s x mbu {hw.mbu:.2f}, NVLink {hw.intra_bw / 1e9:.0f} GB/s and network "
        f"{hw.inter_bw / 1e9:.0f} GB/s each way per GPU, PCIe {hw.host_bw / 1e9:.0f} GB/s, {hw.mem_gib:.1f} GiB "
        f"({hw.source}).",
        "FLOPs: prefix/cost.py's terms (2 per weight per token in every projection and MLP, 4 x heads x head_dim "
        "per (query, key) pair and layer, causal halves, the whole vision tower per merged visual token (blocks, "
        "patch embedding, mergers, its attention within windows or over frames of "
        f"{s.frame_patches[0]} x {s.frame_patches[1]} patches), the LM head on the scored positions); backward = "
        "2 x forward, recompute = 1 x forward more.",
        f"Decode: per generated token the decoder's weights and LM head (once per wave of {s.max_num_seqs} "
        "sequences) and every attended token's K/V are read; with shared-prefix decoding the prompt's K/V once "
        "per prompt.",
        "Elementwise kernels (fp32 RMSNorm, RoPE, SwiGLU, residual adds: 22 h + 8 (heads + kv_heads) head_dim + "
        f"5 intermediate values per token and layer, x {ELEMENTWISE_PASSES / 2:g}) and fp32 logits, log-softmax "
        "and gather on the scored positions move their bytes at the achieved bandwidth, after the GEMMs.",
        "Collectives: two ring all-reduces per layer per pass over the TP group (2 (n-1)/n of the message each), "
        "not overlapped with compute, plus a latency each; data-parallel gradient reduce-scatter and parameter "
        "all-gather over the network; weight sync moves the remote share of the rebuilt bytes over NVLink.",
        "Rollplex's prefix forwards (reference, old, actor) run in the decode window and hide up to the compute "
        "decode leaves idle (decode time - its compute time); the rest extends the rollout.",
        "Offload: serial colocation moves the fp32 master + Adam moments (12 B per parameter of the shard) and the "
        "bf16 weights out and back over PCIe each step (weight-sync phase); Rollplex streams the permanent state "
        "during the optimizer step (hidden behind the update only when PCIe keeps up).",
        "Memory per GPU per phase: memory/planner.py (plan-memory): TRL and serial use its serial-colocation plan, "
        "Rollplex its Rollplex plan.",
    ]


def _fmt_s(x: float) -> str:
    return f"{x:9.3f}" if x < 100 else f"{x:9.1f}"


def format_plan(plan: RunPlan) -> str:
    s, hw, m = plan.spec, plan.hardware, plan.model
    names = list(plan.predictions)
    lines = [
        f"Predicted GRPO step: {m.name} ({m.num_params() / 1e9:.2f} B params) on {s.num_gpus} x {hw.name}, train TP "
        f"{s.train_tp}, rollout TP {s.rollout_tp}; B = {s.batch} prompts/step (global), G = {s.num_generations}, "
        f"P = {s.prompt_len} ({s.visual_tokens:.0f} visual), C = {s.completion_len}, {s.precision}",
        "",
        f"{'phase':16s} " + " ".join(f"{n + ' s':>10s}" for n in names)
        + f" {'rollplex bound':>15s} {'mem serial':>11s} {'mem rollplex':>13s}   (GiB per GPU in the phase)",
    ]
    present = {p.name for n in names for p in plan.predictions[n].phases}
    order = [ph for ph in PHASE_ORDER if ph in present]
    for ph in order:
        cells, bound, mem_s, mem_r = [], "", "", ""
        for n in names:
            p = plan.predictions[n].phase(ph)
            cells.append(_fmt_s(p.seconds) + " " if p else f"{'-':>10s}")
        rp = plan.predictions["rollplex"].phase(ph)
        if rp:
            bound = rp.bound + (" (hidden)" if rp.lane == "prefix" else "")
            mem_r = f"{plan.phase_memory_gib('rollplex', rp.memory_phase):13.1f}"
        sp = plan.predictions["serial"].phase(ph)
        if sp:
            mem_s = f"{plan.phase_memory_gib('serial', sp.memory_phase):11.1f}"
        lines.append(f"{ph:16s} " + " ".join(cells) + f" {bound:>15s} {mem_s:>11s} {mem_r:>13s}")
    lines.append(f"{'STEP':16s} " + " ".join(_fmt_s(plan.predictions[n].step_s) + " " for n in names))
    hidden = plan.predictions["rollplex"].hidden_s
    lines += [
        "",
        f"Rollplex vs TRL: {plan.speedup_vs_trl:.2f}x faster (ratio Rollplex/TRL {1 / plan.speedup_vs_trl:.3f}); "
        f"vs serial colocation: {plan.speedup_vs_serial:.2f}x; prefix work hidden in the decode window: "
        f"{hidden:.2f} s",
        "Peak memory per GPU: " + ", ".join(
            f"{n} {plan.memory[n].total_bytes / GIB:.1f} GiB in {plan.memory[n].peak_phase.value} "
            f"({'fits' if plan.fits(n) else 'DOES NOT FIT'})" for n in names)
        + f" of {hw.mem_gib:.1f} GiB",
        "Host memory per GPU (offloaded training state): " + ", ".join(
            f"{n} {host_state_gib(plan, n):.1f} GiB" for n in names),
    ]
    for o in plan.overflows:
        lines.append("DOES NOT FIT: " + o.describe())
    if plan.suggestion:
        g = plan.suggestion
        lines.append(f"Cheapest setting that fits (Rollplex): {g['change']}: {g['num_gpus']} GPUs, step "
                     f"{g['step_s']:.2f} s, peak {g['peak_gib']:.1f} GiB in {g['peak_phase']}")
    elif not plan.fits("rollplex"):
        lines.append("No single change, pair or triple of changes tried makes the Rollplex plan fit.")
    lines += ["", "Speed-up over serial colocation, Rollplex's mechanisms added one at a time:"]
    for r in plan.ablation:
        lines.append(f"  + {r['added']:24s} step {r['step_s']:9.3f} s  {r['speedup_vs_serial']:.2f}x")
    cmp = paper_comparison(plan)
    if cmp:
        lo, hi = cmp["paper_speedup_vs_serial"]
        lines += ["", "Paper check: predicted speed-up over serial colocation "
                      f"{cmp['predicted_speedup_vs_serial']:.2f}x vs the paper's measured {lo:.2f}-{hi:.2f}x. "
                      "Assumptions:"]
        lines += [f"  - {a}" for a in cmp["assumptions"]]
    for n in names:
        for note in plan.predictions[n].notes:
            lines.append(f"Note ({n}): {note}")
    lines += ["", "Assumptions:"] + [f"  - {a}" for a in assumptions(plan)]
    return "\n".join(lines)

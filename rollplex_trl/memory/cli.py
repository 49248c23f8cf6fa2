"""`rollplex-trl plan-memory`: per-GPU memory by lifetime class for serial colocation, naive overlap and Rollplex."""

from __future__ import annotations

import argparse
import json
import sys

from rollplex_trl.data.video import VideoSamplingConfig
from rollplex_trl.memory.host import HostMediaPlan, SourceClip, format_host_plan, plan_host_media
from rollplex_trl.memory.model_dims import resolve_model
from rollplex_trl.memory.planner import (
    CLASSES,
    GIB,
    PHASES,
    Assumptions,
    MemoryPlanReport,
    Workload,
    plan_memory,
)

_DEFAULT_WL = Workload()
_DEFAULT_A = Assumptions()


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan-memory",
        help="per-GPU memory plan: serial colocation, naive overlap, Rollplex",
        description="Analytic per-GPU memory of one GRPO step by lifetime class, for serial colocation, naive "
                    "overlap and the Rollplex plan. Every assumption is printed with the result.",
    )
    p.add_argument("--model", default="Qwen2.5-VL-32B",
                   help="preset (Qwen2.5-VL-3B/7B/32B/72B) or path of an HF config.json or checkpoint directory")
    p.add_argument("--train-tp", type=int, default=_DEFAULT_WL.train_tp, help="training tensor-parallel degree T")
    p.add_argument("--rollout-tp", type=int, default=_DEFAULT_WL.rollout_tp, help="rollout tensor-parallel degree R")
    p.add_argument("--num-gpus", type=int, default=_DEFAULT_WL.num_gpus, help="GPUs in the job (paper: 32)")
    p.add_argument("--batch", type=int, default=_DEFAULT_WL.batch,
                   help="B: prompts per optimizer step, GLOBAL (over all GPUs)")
    p.add_argument("--num-generations", type=int, default=_DEFAULT_WL.num_generations, help="G: samples per prompt")
    p.add_argument("--prompt-len", type=int, default=_DEFAULT_WL.prompt_len, help="P: prompt tokens (video incl.)")
    p.add_argument("--completion-len", type=int, default=_DEFAULT_WL.completion_len, help="C: completion tokens")
    p.add_argument("--device-mem-gib", type=float, default=_DEFAULT_WL.device_mem_gib, help="M: GiB per GPU")
    p.add_argument("--micro-batch", type=int, default=_DEFAULT_WL.micro_batch,
                   help="sequences per training/scoring forward-backward")
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=_DEFAULT_A.vllm_gpu_memory_utilization,
                   help="vLLM's reservation in serial and naive plans")
    p.add_argument("--optimizer-chunk-mib", type=int, default=_DEFAULT_A.optimizer_chunk_mib,
                   help="Rollplex: streamed optimizer chunk size")
    p.add_argument("--grad-bytes", type=int, default=_DEFAULT_A.grad_bytes, choices=[2, 4],
                   help="bytes per gradient value (4: fp32 main_grad, 2: bf16)")
    p.add_argument("--no-reference", action="store_true", help="no reference model (KL beta = 0)")
    p.add_argument("--no-distributed-optimizer", action="store_true",
                   help="do not shard master weights and moments over data-parallel ranks")
    p.add_argument("--prefix-caching", action="store_true", help="the G samples of a prompt share its KV blocks")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw the three stacks (needs matplotlib)")
    video = p.add_argument_group("host memory of the video data (printed when --video-source is given)")
    video.add_argument("--video-source", metavar="WxH", help="a typical source video's resolution, e.g. 1280x720")
    video.add_argument("--video-source-fps", type=float, default=30.0, help="its frame rate")
    video.add_argument("--video-seconds", type=float, default=60.0, help="its length in seconds")
    sampling = VideoSamplingConfig()
    video.add_argument("--video-fps", type=float, default=sampling.fps, help="rollplex_video_fps")
    video.add_argument("--video-max-frames", type=int, default=sampling.max_frames, help="rollplex_video_max_frames")
    video.add_argument("--video-min-pixels", type=int, default=sampling.min_pixels, help="rollplex_video_min_pixels")
    video.add_argument("--video-max-pixels", type=int, default=sampling.max_pixels, help="rollplex_video_max_pixels")
    video.add_argument("--media-cache", type=int, default=64, help="rollplex_media_cache_size (rows)")
    video.add_argument("--decode-workers", type=int, default=1, help="clips decoded at once per training process")
    video.add_argument("--vllm", action="store_true", help="vLLM rollout: prepared rows also keep the frames")
    p.set_defaults(func=run)
    return p


def _host_plan(args: argparse.Namespace, wl: Workload) -> tuple[HostMediaPlan, SourceClip] | None:
    """The host-memory plan of the video settings, or None without --video-source."""
    if not args.video_source:
        return None
    try:
        width, height = (int(x) for x in args.video_source.lower().split("x"))
    except ValueError:
        raise ValueError(f"--video-source {args.video_source!r}: expected WIDTHxHEIGHT, e.g. 1280x720") from None
    clip = SourceClip(height=height, width=width, fps=args.video_source_fps, seconds=args.video_seconds)
    sampling = VideoSamplingConfig(fps=args.video_fps, max_frames=args.video_max_frames,
                                   min_pixels=args.video_min_pixels, max_pixels=args.video_max_pixels)
    data_parallel = max(1, wl.num_gpus // wl.train_tp)  # the training processes that each hold a share of the batch
    plan = plan_host_media(clip, sampling, cache_rows=args.media_cache, workers=args.decode_workers,
                           batch_rows=-(-wl.batch // data_parallel), keep_frames=args.vllm)
    return plan, clip


def run(args: argparse.Namespace) -> int:
    try:
        model = resolve_model(args.model)
        wl = Workload(train_tp=args.train_tp, rollout_tp=args.rollout_tp, num_gpus=args.num_gpus, batch=args.batch,
                      num_generations=args.num_generations, prompt_len=args.prompt_len,
                      completion_len=args.completion_len, device_mem_gib=args.device_mem_gib,
                      micro_batch=args.micro_batch)
        host = _host_plan(args, wl)
    except ValueError as exc:  # (a RollplexDataError from the video settings is a ValueError too)
        print(f"plan-memory: {exc}", file=sys.stderr)
        return 2
    a = Assumptions(vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                    optimizer_chunk_mib=args.optimizer_chunk_mib, grad_bytes=args.grad_bytes,
                    reference_model=not args.no_reference, distributed_optimizer=not args.no_distributed_optimizer,
                    prefix_caching=args.prefix_caching)
    report = plan_memory(model, wl, a)
    if args.plot:
        from rollplex_trl.memory.plot import plot_plans

        path = plot_plans(report, args.plot)
        if not args.json:
            print(f"plot written to {path}")
    if args.json:
        out = report.to_json()
        if host is not None:
            out["host"] = {"frames": host[0].frames, "height": host[0].height, "width": host[0].width,
                           **{name: nbytes for name, nbytes in host[0].rows()}}
        print(json.dumps(out, indent=2))
    else:
        print(format_report(report))
        if host is not None:
            print("\n" + format_host_plan(*host))
    return 0


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f}"


def format_report(report: MemoryPlanReport) -> str:
    m, wl, plans = report.model, report.workload, report.plans
    names = list(plans)
    head = ["serial", "naive", "rollplex"]
    lines = [
        f"Per-GPU memory plan: {m.name} ({m.num_params() / 1e9:.2f} B params), train TP {wl.train_tp}, rollout TP "
        f"{wl.rollout_tp}, {wl.num_gpus} GPUs, B = {wl.batch} prompts/step (global), G = {wl.num_generations}, "
        f"P = {wl.prompt_len}, C = {wl.completion_len}, device {wl.device_mem_gib:g} GiB",
        "",
        "GiB per GPU resident in each plan's peak phase ('-': not resident then; 'x': not in this plan)",
        f"{'component':48s} {'class':12s} " + " ".join(f"{h:>8s}" for h in head),
    ]
    rows: dict[str, str] = {}
    for plan in plans.values():
        for e in plan.entries:
            rows.setdefault(e.component, e.lifetime)
    for comp, cls in rows.items():
        cells = []
        for n in names:
            plan = plans[n]
            entry = next((e for e in plan.entries if e.component == comp), None)
            cells.append("       x" if entry is None else
                         (_gib(entry.nbytes) if plan.peak_phase in entry.phases else "       -"))
        lines.append(f"{comp:48s} {cls:12s} " + " ".join(cells))
    lines.append(f"{'TOTAL (peak phase)':61s} " + " ".join(_gib(plans[n].total_bytes) for n in names))
    lines.append(f"{'peak phase':61s} " + " ".join(f"{plans[n].peak_phase.value:>8s}" for n in names))
    lines.append(f"{f'fits in {wl.device_mem_gib:g} GiB':61s} "
                 + " ".join(f"{'yes' if plans[n].fits else 'NO':>8s}" for n in names))
    lines += ["", "By lifetime class at the peak phase (GiB):",
              f"{'class':61s} " + " ".join(f"{h:>8s}" for h in head)]
    for cls in CLASSES:
        lines.append(f"{cls:61s} " + " ".join(_gib(plans[n].by_class()[cls]) for n in names))
    lines += ["", "Per-phase totals (GiB):", f"{'plan':14s} " + " ".join(f"{p.value:>10s}" for p in PHASES)]
    for n in names:
        lines.append(f"{n:14s} " + " ".join(f"{plans[n].phase_bytes(p) / GIB:10.2f}" for p in PHASES))
    check = report.paper_check()
    if check is not None:
        lines += ["", f"Paper check: naive overlap {check['naive_gib']:.1f} GiB vs the paper's "
                      f"~{check['paper_naive_gib']:g} GiB per GPU: {check['relative_error']:+.1%} "
                      f"({'within' if check['within_10_percent'] else 'OUTSIDE'} +-10%)"]
    for n in names:
        for note in plans[n].notes:
            lines.append(f"Note ({n}): {note}")
    rp = plans["rollplex"]
    if not rp.fits:
        lines.append(f"Rollplex plan does NOT fit: peak {rp.total_bytes / GIB:.1f} GiB in {rp.peak_phase.value} > "
                     f"{wl.device_mem_gib:g} GiB.")
    lines += ["", "Assumptions:"] + [f"  - {s}" for s in report.assumptions.describe(m, wl)]
    lines += ["", "Formulas:"] + [f"  - {c.name}: {c.formula}" for c in report.components.values()]
    return "\n".join(lines)

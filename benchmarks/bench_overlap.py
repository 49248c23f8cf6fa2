"""Benchmark: serial / shared prefix / shared prefix + overlap, side by side in one run (issue "Overlap").

Three RollplexGRPOTrainer runs on the same data and seed, differing only in the schedule:
- serial:   rollplex_share_prefix="off" (TRL's full forward per completion, prefill G times);
- shared:   shared prefix, prefix jobs run right after decoding (the serial schedule of the same work);
- overlap:  shared prefix, prefix jobs (reference, actor) run inside the decode window (CPU: the worker thread gets
            `--prefix-threads` cores, decoding keeps the rest).
Reported per mode: median wall-clock step (`bench_common.wall_step_clock`; TRL's `step_time` beside it in the
JSON) over the measured steps, and for the shared modes the decode time, prefix
time, hidden time and critical path of each rollout window. The analytic bound of the overlap is
min(T_prefix - dD, T_decode) (T_* from the shared run, dD = decode slowdown caused by the overlap); the achieved
reduction is (T_decode + T_prefix)_shared - critical_path_overlap.

With `--engine vllm` (run it in .venv-vllm: `.venv-vllm/bin/python benchmarks/bench_overlap.py --engine vllm`) the
rollout is the colocated vLLM engine on the text-only small Qwen2 (vLLM's CPU build cannot load Qwen2.5-VL) with
long text prompts standing in for the visual prefix, and the prefix jobs run while vLLM decodes. Completions are
forced to C tokens (`min_tokens`); vLLM's processed log-probs then exclude EOS, so TRL's importance-sampling ratio is
below 1 in this benchmark by design, not from a stale sync.

Usage: .venv/bin/python benchmarks/bench_overlap.py [--steps 6] [--out benchmarks/results/overlap.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import warnings
from pathlib import Path

import torch
from bench_common import run_meta, wall_step_clock


def _run(mode: str, model_path, dataset, tmp: Path, args) -> dict:
    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.data import accuracy_reward, format_reward

    common = dict(
        output_dir=str(tmp / mode), max_steps=args.steps, per_device_train_batch_size=args.generations,
        num_generations=args.generations, max_completion_length=args.completion_length, beta=0.04,
        learning_rate=1e-6, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        use_cpu=not torch.cuda.is_available(), bf16=False, gradient_checkpointing=True,
        rollplex_share_prefix="off" if mode == "serial" else "auto",
        rollplex_overlap="off" if mode == "serial" else "on",
        rollplex_overlap_threads=args.prefix_threads, rollplex_timeline=True,
    )
    if args.engine == "vllm":
        config = RollplexGRPOConfig(
            **common, use_vllm=True, vllm_mode="colocate", rollplex_vllm_dtype="float32",
            vllm_max_model_length=args.prompt_tokens + args.completion_length + 64, vllm_gpu_memory_utilization=0.3,
            generation_kwargs={"min_tokens": args.completion_length})
        rewards = [_length_reward]
    else:
        config = RollplexGRPOConfig(
            **common, generation_kwargs={"min_new_tokens": args.completion_length},
            rollplex_video_max_frames=args.frames, rollplex_video_min_pixels=28 * 28 * 4,
            rollplex_video_max_pixels=args.size * args.size)
        rewards = [accuracy_reward, format_reward]
    trainer = RollplexGRPOTrainer(model=str(model_path), reward_funcs=rewards, args=config, train_dataset=dataset)
    if trainer.overlap is not None:
        trainer.overlap.force_serial = mode == "shared"
    clock = wall_step_clock()
    trainer.add_callback(clock)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "step_time" in r][1:]  # first step: warm-up

    def med(key):
        values = [r[key] for r in logs if key in r]
        return statistics.median(values) if values else None

    return {"step_s": statistics.median(clock.steps[1:]), "trl_step_time_s": med("step_time"),
            "decode_s": med("rollplex/decode_s"), "prefix_s": med("rollplex/prefix_s"),
            "hidden_s": med("rollplex/hidden_s"), "critical_path_s": med("rollplex/critical_path_s"),
            "timeline": str(tmp / mode / "rollplex_timeline.png")}


def _length_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 7) for c in completions]


def _text_dataset(num_prompts: int, prompt_tokens: int):
    """Prompts of about `prompt_tokens` tokens (the small checkpoint's byte-level BPE: ~1 token per character of
    these words), each different, standing in for a video prompt's long prefix."""
    from datasets import Dataset

    words = ["red", "ball", "moves", "left", "blue", "box", "turns", "green", "dot", "fades"]
    rows = []
    for i in range(num_prompts):
        text = " ".join(words[(i + k) % len(words)] for k in range(prompt_tokens // 4))[:prompt_tokens]
        rows.append({"prompt": [{"role": "user", "content": f"{i}: {text} Which colour moved?"}]})
    return Dataset.from_list(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prefix-threads", type=int, default=1)
    parser.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="--engine vllm: text prompt length")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/overlap[_vllm].json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    from rollplex_trl.data import SyntheticVideoConfig, load_video_r1, write_synthetic_video_dataset
    from rollplex_trl.testing.checkpoints import get_checkpoint

    hf_logging.disable_progress_bar()
    tmp = Path(tempfile.mkdtemp(prefix="rollplex-overlap-"))
    args.out = args.out or f"benchmarks/results/overlap{'_vllm' if args.engine == 'vllm' else ''}.json"
    if args.engine == "vllm":
        model_path = get_checkpoint("qwen2", args.preset)
        dataset = _text_dataset(max(8, args.steps), args.prompt_tokens)
    else:
        model_path = get_checkpoint("qwen2_5_vl", args.preset)
        annotations = write_synthetic_video_dataset(tmp / "data", SyntheticVideoConfig(
            num_samples=max(8, args.steps), seed=0, num_frames=args.frames, height=args.size, width=args.size, fps=2))
        dataset = load_video_r1(annotations)
    results = {}
    for mode in ("serial", "shared", "overlap"):
        torch.manual_seed(0)
        results[mode] = _run(mode, model_path, dataset, tmp, args)
        print(mode, {k: v for k, v in results[mode].items() if k != "timeline"}, flush=True)

    shared, over = results["shared"], results["overlap"]
    slowdown = over["decode_s"] - shared["decode_s"]
    bound = min(shared["prefix_s"] - slowdown, shared["decode_s"])
    achieved = shared["decode_s"] + shared["prefix_s"] - over["critical_path_s"]
    summary = {
        "step_ratio_serial_over_shared": results["serial"]["step_s"] / shared["step_s"],
        "step_ratio_serial_over_overlap": results["serial"]["step_s"] / over["step_s"],
        "step_ratio_shared_over_overlap": shared["step_s"] / over["step_s"],
        "decode_slowdown_s": slowdown, "bound_s": bound, "achieved_reduction_s": achieved,
        "achieved_share_of_bound": achieved / bound if bound > 0 else None,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**run_meta(), "engine": args.engine, "prompt_tokens": args.prompt_tokens if args.engine == "vllm" else None,
            "preset": args.preset, "G": args.generations, "C": args.completion_length, "frames": args.frames,
            "size": args.size, "steps": args.steps, "prefix_threads": args.prefix_threads,
            "threads": torch.get_num_threads(), "device": "cuda" if torch.cuda.is_available() else "cpu"}
    out.write_text(json.dumps({"meta": meta, "modes": results, "summary": summary}, indent=2))
    print("\n| mode | step (s, median) | decode (s) | prefix (s) | hidden (s) | critical path (s) |")
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        cells = [f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("step_s", "decode_s", "prefix_s", "hidden_s",
                                                                       "critical_path_s")]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    print(f"\nstep ratio serial/shared {summary['step_ratio_serial_over_shared']:.2f}x, serial/overlap "
          f"{summary['step_ratio_serial_over_overlap']:.2f}x, "
          f"shared/overlap {summary['step_ratio_shared_over_overlap']:.2f}x")
    share = summary["achieved_share_of_bound"]
    print(f"overlap bound min(T_prefix - dD, T_decode) = {bound:.3f} s, achieved {achieved:.3f} s"
          + (f" ({share:.0%} of the bound)" if share is not None else ""))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

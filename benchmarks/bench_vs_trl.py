"""Benchmark: the whole GRPO step of plain `trl.GRPOTrainer` vs `RollplexGRPOTrainer`, side by side in one run.

TRL has no video path, so the workload is an image one: the `small` local Qwen2.5-VL (or `--family qwen3-vl`: a
Qwen3-VL of the same sizes), prompts of one S x S image
(S = 448: 256 visual tokens) and a one-line question, G completions per prompt forced to exactly C tokens
(`min_new_tokens`), so the prompt share P / (P + C) is ~90% at C = 32. Both trainers get the same configuration
(TRL's defaults unless `--fp32`: bf16 autocast, gradient checkpointing, beta = 0, loss "dapo"), the same data, seed
and reward; Rollplex runs its defaults (shared prefix with cascade suffix attention, shared-prefix decoding from
G = 8, the serial overlap schedule on CPU). Runs alternate TRL, Rollplex, TRL, ... (`--repeats` each); each run's
step time is the median over its steps after the first of the wall-clock step (rollout to optimizer step and weight
sync: `bench_common.wall_step_clock`); the table shows the medians over runs and their ratio, and TRL's own
`step_time` metric (its `training_step` only: no clipping or optimizer step) beside it.

Usage:  .venv/bin/python benchmarks/bench_vs_trl.py [--generations 8] [--completion-length 32] [--repeats 2] [--fp32]
        [--peft] [--compile-decode] [--family qwen3-vl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from bench_common import add_image_workload_args, quiet_checkpoint, run_meta, wall_step_clock


def _image_dataset(num_prompts: int, size: int, seed: int = 0):
    """Prompts with one `size` x `size` image each (a coloured square on white, TRL's image columns)."""
    import random

    from datasets import Dataset
    from PIL import Image

    from rollplex_trl.data.toy import COLOURS

    rng = random.Random(seed)
    rows = []
    for i in range(num_prompts):
        name = rng.choice(list(COLOURS))
        image = Image.new("RGB", (size, size), (255, 255, 255))
        lo, hi = size // 4 + i % 8, 3 * size // 4
        image.paste(COLOURS[name], (lo, lo, hi, hi))
        rows.append({"prompt": [{"role": "user", "content": "What colour is the square? Answer with one word."}],
                     "image": image, "solution": name})
    return Dataset.from_list(rows)


def _run(kind: str, model_path: Path, dataset, tmp: Path, args, index: int) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.data.toy import answer_reward

    common = dict(
        output_dir=str(tmp / f"{kind}-{index}"), max_steps=args.steps, per_device_train_batch_size=args.generations,
        num_generations=args.generations, max_completion_length=args.completion_length,
        generation_kwargs={"min_new_tokens": args.completion_length}, logging_steps=1, report_to=[],
        save_strategy="no", seed=0, use_cpu=not torch.cuda.is_available(), learning_rate=1e-6)
    if args.fp32:
        common.update(bf16=False, gradient_checkpointing=False)
    if kind == "rollplex_compiled":  # the defaults plus the compiled decode step (its compile lands in step 1)
        common.update(rollplex_compile_decode="on")
    config, trainer_class = ((GRPOConfig(**common), GRPOTrainer) if kind == "trl"
                             else (RollplexGRPOConfig(**common), RollplexGRPOTrainer))
    peft = {}
    if args.peft:  # LoRA on the attention projections: the base weights frozen (fp32, as TRL loads them)
        from peft import LoraConfig

        peft = {"peft_config": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                              "o_proj"])}
    trainer = trainer_class(model=str(model_path), reward_funcs=[answer_reward], args=config, train_dataset=dataset,
                            **peft)
    clock = wall_step_clock()
    trainer.add_callback(clock)
    trainer.train()
    trl_step_time = [r["step_time"] for r in trainer.state.log_history if "step_time" in r][1:]
    steps = clock.steps[1:]  # drop the warm-up step
    return {"step_s": statistics.median(steps), "steps": steps, "first_step_s": clock.steps[0],
            "trl_step_time_s": statistics.median(trl_step_time),
            "num_tokens": max(r.get("num_tokens", 0) for r in trainer.state.log_history)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_image_workload_args(parser, repeats=2)
    parser.add_argument("--fp32", action="store_true", help="fp32 without gradient checkpointing for both")
    parser.add_argument("--compile-decode", action="store_true",
                        help="also run Rollplex with rollplex_compile_decode='on' (its compile is in the dropped first "
                        "step, reported as first_step_s)")
    parser.add_argument("--peft", action="store_true",
                        help="both trainers train a LoRA adapter (r 8 on q/k/v/o) instead of the whole model")
    parser.add_argument("--out", default="benchmarks/results/vs_trl.json")
    args = parser.parse_args()
    model_path = quiet_checkpoint(args.preset, args.family)
    tmp = Path(tempfile.mkdtemp(prefix="rollplex-bench-trl-"))
    dataset = _image_dataset(args.steps, args.image_size)
    kinds = ("trl", "rollplex", "rollplex_compiled") if args.compile_decode else ("trl", "rollplex")
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for index in range(args.repeats):
        for kind in kinds:
            torch.manual_seed(0)
            runs[kind].append(_run(kind, model_path, dataset, tmp, args, index))
            print(f"{kind:>8} run {index}: step {runs[kind][-1]['step_s']:.3f} s", flush=True)

    trl_s = statistics.median(r["step_s"] for r in runs["trl"])
    ours_s = statistics.median(r["step_s"] for r in runs["rollplex"])
    tokens = runs["trl"][0]["num_tokens"] / args.steps / args.generations  # P + C per sequence
    share = 1 - args.completion_length / tokens
    result = {"meta": {**run_meta(), "preset": args.preset, "family": args.family, "G": args.generations,
                       "C": args.completion_length,
                       "image_size": args.image_size, "prompt_share": share, "steps": args.steps,
                       "repeats": args.repeats, "precision": "fp32" if args.fp32 else "bf16 autocast + checkpointing",
                       "peft": "LoRA r 8 on q/k/v/o" if args.peft else None,
                       "device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(),
                       "torch": torch.__version__},
              "runs": runs, "trl_step_s": trl_s, "rollplex_step_s": ours_s, "ratio": trl_s / ours_s,
              "step_time_metric": {kind: statistics.median(r["trl_step_time_s"] for r in rs)
                                   for kind, rs in runs.items()}}
    if args.compile_decode:
        compiled_s = statistics.median(r["step_s"] for r in runs["rollplex_compiled"])
        result.update(rollplex_compiled_step_s=compiled_s, ratio_compiled=trl_s / compiled_s,
                      rollplex_compiled_first_step_s=[r["first_step_s"] for r in runs["rollplex_compiled"]])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print()
    metric = result["step_time_metric"]
    print("| workload | G | C | prompt share | trl.GRPOTrainer step (s) | RollplexGRPOTrainer step (s) | ratio | "
          "TRL's `step_time` metric, trl / rollplex (s) |")
    print("|---|---|---|---|---|---|---|---|")
    lora = ", LoRA" if args.peft else ""
    print(f"| image {args.image_size}² ({result['meta']['precision']}{lora}) | {args.generations} | "
          f"{args.completion_length} | {share:.0%} | {trl_s:.3f} | {ours_s:.3f} | **{trl_s / ours_s:.2f}×** | "
          f"{metric['trl']:.3f} / {metric['rollplex']:.3f} |")
    if args.compile_decode:
        print(f"| same, `rollplex_compile_decode=\"on\"` (first step: {result['rollplex_compiled_first_step_s']}) | "
              f"{args.generations} | {args.completion_length} | {share:.0%} | {trl_s:.3f} | "
              f"{result['rollplex_compiled_step_s']:.3f} | **{result['ratio_compiled']:.2f}×** |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

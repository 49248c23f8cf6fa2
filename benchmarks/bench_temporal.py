"""Benchmark: what T-GRPO's shuffled rollout costs, plain GRPO and two T-GRPO rollouts side by side in one run.

The workload is the synthetic video task (real MP4s, `rollplex_trl.data.write_synthetic_video_dataset`) on a local
Qwen2.5-VL preset: P prompts per step, G completions of exactly C tokens, `rollplex_temporal_generations` = G/2
shuffled completions per prompt. Three configurations, identical otherwise:

- `GRPO`: the recipe off (the cost T-GRPO adds to);
- `T-GRPO naive`: the shuffled rows through TRL's own `_generate_single_turn`, as Video-R1 samples them (every
  shuffled row prefills the whole video prompt);
- `T-GRPO`: the trainer's rollout (`TrainerRollout.extra_samples`: shared prefill, shared-prefix decode), frames
  shuffled one by one (Video-R1's granularity, the default);
- `T-GRPO patch`: the same with `rollplex_temporal_shuffle="patch"` (temporal patches shuffled): the shuffled
  prefill permutes the ordered prefill's video features instead of running the vision tower
  (prefix/vision_reuse.py).

Runs alternate (a load spike hits one run of each); each run's step is the median wall-clock step
(`bench_common.wall_step_clock`) after the first; the table shows medians over runs and each T-GRPO's step over
GRPO's (its overhead), and naive over ours.

Usage:  OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_temporal.py [--preset tiny] [--repeats 3] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from bench_common import quiet_checkpoint, synthetic_video_dataset, wall_step_clock, write_video_result

CONFIGS = ("GRPO", "T-GRPO naive", "T-GRPO", "T-GRPO patch")


def _run(name: str, model_path: Path, dataset, tmp: Path, args, index: int) -> dict:
    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.data import accuracy_reward, format_reward
    from rollplex_trl.data.prompt import generation_fields

    G, C = args.generations, args.completion_length
    config = RollplexGRPOConfig(
        output_dir=str(tmp / f"{name.replace(' ', '_')}-{index}"), max_steps=args.steps,
        per_device_train_batch_size=G * args.prompts, num_generations=G, max_completion_length=C,
        generation_kwargs={"min_new_tokens": C}, learning_rate=1e-6, logging_steps=1, report_to=[],
        save_strategy="no", seed=0, use_cpu=not torch.cuda.is_available(), bf16=args.bf16, disable_tqdm=True,
        rollplex_video_max_frames=args.frames, rollplex_video_min_pixels=28 * 28 * 4,
        rollplex_video_max_pixels=args.size * args.size, rollplex_temporal=name != "GRPO",
        rollplex_temporal_shuffle="patch" if name == "T-GRPO patch" else "frame")
    trainer = RollplexGRPOTrainer(model=str(model_path), reward_funcs=[accuracy_reward, format_reward], args=config,
                                  train_dataset=dataset)
    if name == "T-GRPO naive":
        trainer.rollout.extra_samples = lambda ids, rows, n, trl_generate: trl_generate(
            ids, None, generation_fields(rows), n, False)[0]
    clock = wall_step_clock()
    trainer.add_callback(clock)
    trainer.train()
    logs = trainer.state.log_history
    groups = [r["rollplex/temporal_groups"] for r in logs if "rollplex/temporal_groups" in r]
    reused = [r["rollplex/temporal_vision_reused"] for r in logs if "rollplex/temporal_vision_reused" in r]
    shuffled_s = [r["rollplex/temporal_rollout_s"] for r in logs if "rollplex/temporal_rollout_s" in r]
    return {"step_s": statistics.median(clock.steps[1:]), "steps": clock.steps,
            "shuffled_rollout_s": statistics.median(shuffled_s[1:]) if len(shuffled_s) > 1 else 0.0,
            "shuffled_groups_per_step": statistics.mean(groups) if groups else 0.0,
            "vision_reused": statistics.mean(reused) if reused else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--size", type=int, default=112, help="clip height and width (pixels)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="TRL's default precision (bf16 autocast)")
    parser.add_argument("--out", default="benchmarks/results/temporal.json")
    args = parser.parse_args()
    model_path = quiet_checkpoint(args.preset)
    tmp = Path(tempfile.mkdtemp(prefix="rollplex-bench-temporal-"))
    dataset = synthetic_video_dataset(tmp / "data", args.prompts * args.steps, args.frames, args.size)
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for index in range(args.repeats):
        for name in CONFIGS:
            torch.manual_seed(0)
            result = _run(name, model_path, dataset, tmp, args, index)
            runs[name].append(result)
            print(f"{name:>13} run {index}: step {result['step_s']:.3f} s", flush=True)
    step = {name: statistics.median(r["step_s"] for r in runs[name]) for name in CONFIGS}
    table = {name: {"step_s": step[name], "vs_grpo": step[name] / step["GRPO"],
                    "shuffled_groups_per_step": runs[name][0]["shuffled_groups_per_step"],
                    "vision_reused": runs[name][0]["vision_reused"],
                    "shuffled_rollout_s": statistics.median(r["shuffled_rollout_s"] for r in runs[name])}
             for name in CONFIGS}
    for name in ("T-GRPO", "T-GRPO patch"):
        table[name]["naive_over_ours"] = step["T-GRPO naive"] / step[name]
    out = write_video_result(args.out, args, runs, table)
    print("\n| configuration | step (s) | step / GRPO's | shuffled rollout (s) | shuffled groups per step | "
          "shuffled videos not re-encoded |")
    print("|---|---|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['step_s']:.3f} | {row['vs_grpo']:.2f}× | {row['shuffled_rollout_s']:.3f} | "
              f"{row['shuffled_groups_per_step']:.1f} | {row['vision_reused']:.2f} |")
    print(f"\nnaive / ours: frame **{table['T-GRPO']['naive_over_ours']:.2f}×**, patch "
          f"**{table['T-GRPO patch']['naive_over_ours']:.2f}×**\nwrote {out}")


if __name__ == "__main__":
    main()

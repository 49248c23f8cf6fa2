"""Benchmark: what the exactness audit (rollplex_verify_every) costs, audited and unaudited runs side by side.

The workload is the synthetic video task on a local Qwen2.5-VL preset (G completions of exactly C tokens, beta > 0
so the reference pass runs too). Two configurations alternate: `rollplex_verify_every=0` (off) and `=1` (every
step audited: the first ref, policy and actor pass of the step recomputed for one group with a plain full forward).
Each run's step is the median wall-clock step after the first. Reported: the audited step over the plain one, the
audit's seconds per audited step, and that cost amortised over the default interval (200 steps) as a fraction of
training time.

Usage:  OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_verify.py [--preset tiny] [--repeats 3] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from bench_common import quiet_checkpoint, synthetic_video_dataset, wall_step_clock, write_video_result

AUTO_EVERY = 200


def _run(every: int, model_path: Path, dataset, tmp: Path, args, index: int) -> float:
    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.data import accuracy_reward, format_reward

    G, C = args.generations, args.completion_length
    config = RollplexGRPOConfig(
        output_dir=str(tmp / f"every{every}-{index}"), max_steps=args.steps,
        per_device_train_batch_size=G * args.prompts,
        num_generations=G, max_completion_length=C, generation_kwargs={"min_new_tokens": C}, beta=0.04,
        learning_rate=1e-6, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        use_cpu=not torch.cuda.is_available(), bf16=args.bf16, disable_tqdm=True,
        rollplex_video_max_frames=args.frames, rollplex_video_min_pixels=28 * 28 * 4,
        rollplex_video_max_pixels=args.size * args.size, rollplex_verify_every=every)
    trainer = RollplexGRPOTrainer(model=str(model_path), reward_funcs=[accuracy_reward, format_reward], args=config,
                                  train_dataset=dataset)
    clock = wall_step_clock()
    trainer.add_callback(clock)
    trainer.train()
    return statistics.median(clock.steps[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/verify.json")
    args = parser.parse_args()
    model_path = quiet_checkpoint(args.preset)
    tmp = Path(tempfile.mkdtemp(prefix="rollplex-bench-verify-"))
    dataset = synthetic_video_dataset(tmp / "data", args.prompts * args.steps, args.frames, args.size)
    runs: dict[str, list[float]] = {"off": [], "every step": []}
    for index in range(args.repeats):
        for name, every in (("off", 0), ("every step", 1)):
            torch.manual_seed(0)
            runs[name].append(_run(every, model_path, dataset, tmp, args, index))
            print(f"{name:>10} run {index}: step {runs[name][-1]:.3f} s", flush=True)
    off, on = statistics.median(runs["off"]), statistics.median(runs["every step"])
    audit_s = on - off
    table = {"off_step_s": off, "audited_step_s": on, "audited_over_off": on / off, "audit_s": audit_s,
             "amortised_fraction_at_200": audit_s / (AUTO_EVERY * off)}
    out = write_video_result(args.out, args, runs, table)
    print("\n| step off (s) | step audited (s) | audited / off | audit (s) | amortised over 200 steps |")
    print("|---|---|---|---|---|")
    amortised = 100 * table["amortised_fraction_at_200"]
    print(f"| {off:.3f} | {on:.3f} | {on / off:.2f}× | {audit_s:.3f} | {amortised:.3f}% |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

"""The exactness audit on this machine: a short video GRPO run with every step audited (rollplex_verify_every=1).

Under TRL's defaults (bf16 autocast where the device has it, gradient checkpointing, beta > 0 so the reference pass
runs), every Rollplex mechanism on at its default, the reference, policy and actor log-probs and the actor's gradient
of each step are recomputed the plain way (trainers/verify.py). Writes the per-step `rollplex/verify_*` values and
whether each is within its tolerance as JSON, and prints them: the first run on new hardware reports exactness on
its own (benchmarks/gpu_h200.sh runs this first).

Usage:  .venv/bin/python benchmarks/gpu_audit.py [--preset tiny] [--steps 2] --out audit.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from bench_common import quiet_checkpoint, run_meta, synthetic_video_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--out", default="audit.json")
    args = parser.parse_args()
    model_path = quiet_checkpoint(args.preset)

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.data import accuracy_reward, format_reward
    from rollplex_trl.trainers.verify import GRAD_TOLERANCE, TOLERANCE, precision_of

    tmp = Path(tempfile.mkdtemp(prefix="rollplex-audit-"))
    dataset = synthetic_video_dataset(tmp / "data", 2 * args.steps, args.frames, args.size)
    cuda = torch.cuda.is_available()
    bf16 = cuda and torch.cuda.is_bf16_supported()
    config = RollplexGRPOConfig(
        output_dir=str(tmp / "run"), max_steps=args.steps, per_device_train_batch_size=2 * args.generations,
        num_generations=args.generations, max_completion_length=16, beta=0.04, learning_rate=1e-6,
        logging_steps=1, report_to=[], save_strategy="no", seed=0, use_cpu=not cuda, bf16=bf16,
        gradient_checkpointing=True, disable_tqdm=True, rollplex_video_max_frames=args.frames,
        rollplex_video_min_pixels=28 * 28 * 4, rollplex_video_max_pixels=args.size * args.size,
        rollplex_verify_every=1)
    trainer = RollplexGRPOTrainer(model=str(model_path), reward_funcs=[accuracy_reward, format_reward], args=config,
                                  train_dataset=dataset)
    trainer.train()
    precision = precision_of(trainer.accelerator.mixed_precision)
    min_cos, max_rel = GRAD_TOLERANCE[precision]
    steps = []
    for record in (r for r in trainer.state.log_history if "loss" in r):
        values = {k.removeprefix("rollplex/verify_"): v for k, v in record.items() if k.startswith("rollplex/verify_")}
        ok = all(v <= TOLERANCE[precision] for k, v in values.items() if k.endswith("_logp_abs"))
        ok = ok and values.get("actor_grad_cos", 1.0) >= min_cos and values.get("actor_grad_rel", 0.0) <= max_rel
        steps.append({"step": record["step"], "within_tolerance": ok, **values})
        print(f"step {record['step']}: {'ok' if ok else 'EXCEEDED'} "
              + ", ".join(f"{k} {v:.3g}" for k, v in values.items()), flush=True)
    result = {"meta": {**run_meta(), "preset": args.preset, "precision": precision,
                       "device": torch.cuda.get_device_name(0) if cuda else "cpu"},
              "tolerance": {"logp_abs": TOLERANCE[precision], "grad_cos": min_cos, "grad_rel": max_rel},
              "steps": steps, "all_within_tolerance": all(s["within_tolerance"] for s in steps) and bool(steps)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"audit: {'all steps within tolerance' if result['all_within_tolerance'] else 'EXCEEDED'}; wrote {args.out}")


if __name__ == "__main__":
    main()

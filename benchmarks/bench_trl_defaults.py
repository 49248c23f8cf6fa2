"""Benchmark: what two mechanisms of the rollout save under TRL's defaults, each on vs off side by side in one run.

The workload is `bench_vs_trl.py`'s (the `small` Qwen2.5-VL, one 448x448 image per prompt, G = 8 completions of
exactly C = 32 tokens, ~90% prompt share) under TRL's defaults (bf16 autocast over fp32 weights, gradient
checkpointing, beta 0, loss "dapo"). Neither mechanism has a switch (both are always exact), so "off" patches the
trainer for the run:

- `kept prefill`: the rollout's prefill, kept with its graph, is the actor's prefix (one policy prompt forward per
  step); off: `TrainerRollout.actor_from_prefill` returns False, so the decode window's actor job runs that
  forward a second time.
- `frozen casts` (`--peft`: both runs train a LoRA adapter, r 8 on q/k/v/o, the base weights frozen): autocast's
  casts of the frozen base weights kept across the decode steps of a `generate` call (rollout/weight_casts.py);
  off: `TrainerRollout.decode_weight_casts` is a no-op and every decode step casts them again, as TRL's `generate` does.

Runs alternate (on, off, on, off, ...: a load spike on the shared machine hits one run of each); each run's step is
the median wall-clock step (`bench_common.wall_step_clock`) after the first, its decode the median of the
trainer's `rollplex/decode_s`; the table shows the medians over runs and the ratio off / on.

Usage:  .venv/bin/python benchmarks/bench_trl_defaults.py [--repeats 3] [--steps 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

import torch
from bench_common import add_image_workload_args, quiet_checkpoint, run_meta, wall_step_clock
from bench_vs_trl import _image_dataset

# (mechanism, whether the runs train a LoRA adapter)
MECHANISMS = {"kept prefill": False, "frozen casts": True}


def _run(mechanism: str, on: bool, model_path: Path, dataset, tmp: Path, args, index: int) -> dict:
    from peft import LoraConfig

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.data.toy import answer_reward

    config = RollplexGRPOConfig(
        output_dir=str(tmp / f"{mechanism.replace(' ', '_')}-{on}-{index}"), max_steps=args.steps,
        per_device_train_batch_size=args.generations, num_generations=args.generations,
        max_completion_length=args.completion_length, generation_kwargs={"min_new_tokens": args.completion_length},
        logging_steps=1, report_to=[], save_strategy="no", seed=0, use_cpu=not torch.cuda.is_available(),
        learning_rate=1e-6, disable_tqdm=True)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    trainer = RollplexGRPOTrainer(model=str(model_path), reward_funcs=[answer_reward], args=config,
                                  train_dataset=dataset, peft_config=lora if MECHANISMS[mechanism] else None)
    if not on and mechanism == "kept prefill":
        trainer.rollout.actor_from_prefill = lambda: False
    if not on and mechanism == "frozen casts":
        trainer.rollout.decode_weight_casts = contextlib.nullcontext
    clock = wall_step_clock()
    trainer.add_callback(clock)
    trainer.train()
    decode = [r["rollplex/decode_s"] for r in trainer.state.log_history if "rollplex/decode_s" in r][1:]
    return {"step_s": statistics.median(clock.steps[1:]), "steps": clock.steps,
            "decode_s": statistics.median(decode) if decode else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_image_workload_args(parser, repeats=3)
    parser.add_argument("--mechanisms", nargs="+", default=list(MECHANISMS), choices=list(MECHANISMS))
    parser.add_argument("--out", default="benchmarks/results/trl_defaults.json")
    args = parser.parse_args()
    model_path = quiet_checkpoint(args.preset, args.family)
    tmp = Path(tempfile.mkdtemp(prefix="rollplex-bench-defaults-"))
    dataset = _image_dataset(args.steps, args.image_size)
    runs = {m: {"on": [], "off": []} for m in args.mechanisms}
    for index in range(args.repeats):
        for mechanism in args.mechanisms:
            for state in ("on", "off"):
                torch.manual_seed(0)
                result = _run(mechanism, state == "on", model_path, dataset, tmp, args, index)
                runs[mechanism][state].append(result)
                print(f"{mechanism:>13} {state:>3} run {index}: step {result['step_s']:.3f} s, decode "
                      f"{result['decode_s']:.3f} s", flush=True)

    def median(mechanism, state, key):
        return statistics.median(r[key] for r in runs[mechanism][state])

    table = {m: {f"{state}_{key}": median(m, state, key) for state in ("on", "off") for key in ("step_s", "decode_s")}
             for m in args.mechanisms}
    for row in table.values():
        row["step_ratio"] = row["off_step_s"] / row["on_step_s"]
        row["decode_ratio"] = row["off_decode_s"] / row["on_decode_s"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**run_meta(), "preset": args.preset, "family": args.family, "G": args.generations,
            "C": args.completion_length,
            "image_size": args.image_size, "steps": args.steps, "repeats": args.repeats,
            "precision": "bf16 autocast + checkpointing", "device": "cuda" if torch.cuda.is_available() else "cpu",
            "threads": torch.get_num_threads(), "torch": torch.__version__}
    out.write_text(json.dumps({"meta": meta, "runs": runs, "table": table}, indent=2))
    print("\n| mechanism | step on (s) | step off (s) | step off / on | decode on (s) | decode off (s) | "
          "decode off / on |")
    print("|---|---|---|---|---|---|---|")
    for m, row in table.items():
        print(f"| {m}{' (LoRA)' if MECHANISMS[m] else ''} | {row['on_step_s']:.3f} | {row['off_step_s']:.3f} | "
              f"**{row['step_ratio']:.2f}×** | {row['on_decode_s']:.3f} | {row['off_decode_s']:.3f} | "
              f"{row['decode_ratio']:.2f}× |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

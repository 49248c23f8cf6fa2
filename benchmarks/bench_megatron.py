"""Benchmark: the Megatron backend (t = 1, t = 2) against the `hf` backend on the same video GRPO workload.

Every configuration trains the same local Qwen2.5-VL (preset `small` by default) on the synthetic video task for
`--steps` steps with the same seed and batch, and reports the median wall-clock step (rollout to optimizer step
and weight sync, `bench_common.wall_step_clock`; the first step is a warm-up and dropped), side by side in one run,
with the ratios to the `hf` backend, and TRL's `step_time` metric (its `training_step` only) beside it:

- `hf, prefix off`: transformers + accelerate, TRL's full forward for every completion (the Megatron backend does
  not share the prefix in its scoring passes yet, so this is the like-for-like baseline),
- `hf` (default): the same with the shared prefix on, for reference,
- `megatron t=1`: one process, Megatron-Core GPTModel,
- `megatron t=2`: two processes (gloo, torchrun), the LLM split over both; on a 2-core machine each process gets one
  intra-op thread, as the single-process runs get two. The rollout model is mapped onto both ranks' shards
  (`rollplex_weight_mapping` auto), its row-parallel weights read in place by split-K Linears
  (`rollplex_row_parallel_views` auto);
- `megatron t=1, own prefill`, `megatron t=2, own prefill`: the rollout model prefills the prompts itself and the
  decode window's job builds the actor's prefix, as before 2026-12-03 (by default the rollout decodes from the
  Megatron policy's prefix pass, kept as the actor's prefix: one prompt forward per step fewer;
  `MegatronBackend.rollout_prefill`);
- `megatron t=2, copied rows`: the same with `rollplex_row_parallel_views="off"` (those weights copied after each
  step);
- `megatron t=2, views`: `rollplex_weight_mapping="off"` (views of local shards, the rest all-gathered after each
  step).
- `megatron t=2, vision replicated`: `rollplex_split_vision="off"` (every TP rank runs the vision tower on every
  video; by default each runs it on its share of them).

The machine is shared and noisy, so the runs alternate: repeat 1 of every configuration, then repeat 2, ...
Besides the ratio of the pooled medians (`x hf`) it reports each repeat's ratio to the `hf` run of the same repeat
(`x hf per repeat`: median, min-max; `vs_hf_per_repeat` in the JSON), which says how far one ratio can be trusted.

For the Megatron runs it also reports the live weight-sync bytes per optimizer step (`rollplex/sync_bytes_copied`,
`rollplex/sync_bytes_aliased`) next to the sharding planner's numbers for the plan the mapping executes (t, r = 1,
the transformers model's unfused consumer: backends/megatron/mapped_weights.py).

Usage:  .venv/bin/python benchmarks/bench_megatron.py [--quick] [--max-tp 1] [--bf16]
            [--out benchmarks/results/megatron.json]

On a GPU (benchmarks/gpu_h200.sh runs it with --max-tp 1: one device) this has never run: no GPU was lent yet.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, backend, t, rollplex_share_prefix, rollplex_weight_mapping, rollplex_row_parallel_views, rollout prefill:
# "policy" = the Megatron policy's prefix pass, kept as the actor's prefix (MegatronBackend.rollout_prefill, the
# default), "rollout" = the rollout model's own prefill and the window's actor job, as before 2026-12-03)
RUNS = [("hf, prefix off", "hf", 1, "off", "auto", "auto", "policy"),
        ("hf (shared prefix)", "hf", 1, "auto", "auto", "auto", "policy"),
        ("megatron t=1", "megatron", 1, "auto", "auto", "auto", "policy"),
        ("megatron t=1, own prefill", "megatron", 1, "auto", "auto", "auto", "rollout"),
        ("megatron t=2", "megatron", 2, "auto", "auto", "auto", "policy"),
        ("megatron t=2, own prefill", "megatron", 2, "auto", "auto", "auto", "rollout"),
        ("megatron t=2, copied rows", "megatron", 2, "auto", "auto", "off", "policy"),
        ("megatron t=2, views", "megatron", 2, "auto", "off", "auto", "policy"),
        ("megatron t=2, vision replicated", "megatron", 2, "auto", "auto", "auto", "policy")]


def worker(argv: list[str]) -> None:
    """One training run (in a child process; under torchrun for t > 1); writes its step times and sync bytes."""
    model_path, data, out, backend, tp, share, mapping, views, prefill, steps, G, C, precision, frames, size = argv
    import torch
    from bench_common import wall_step_clock

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.data import accuracy_reward, format_reward, load_video_r1

    split_vision = "auto"
    if prefill.endswith("+replicated"):  # rollplex_split_vision="off": every TP rank runs the whole vision tower
        prefill, split_vision = prefill.removesuffix("+replicated"), "off"
    if prefill == "rollout":  # the rollout model prefills, the decode window's job builds the actor's prefix
        from rollplex_trl.backends.megatron.backend import MegatronBackend

        MegatronBackend.rollout_prefill = lambda self, training: None

    config = RollplexGRPOConfig(
        output_dir=out, max_steps=int(steps), per_device_train_batch_size=int(G) * 2, num_generations=int(G),
        max_completion_length=int(C), generation_kwargs={"min_new_tokens": int(C)}, beta=0.04, learning_rate=1e-6,
        logging_steps=1, report_to=[], save_strategy="no", seed=0, use_cpu=not torch.cuda.is_available(),
        bf16=precision == "bf16", gradient_checkpointing=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        rollplex_backend=backend, rollplex_tensor_parallel_size=int(tp), rollplex_share_prefix=share,
        rollplex_weight_mapping=mapping, rollplex_row_parallel_views=views, rollplex_split_vision=split_vision,
        rollplex_video_max_frames=int(frames), rollplex_video_min_pixels=28 * 28 * 4,
        rollplex_video_max_pixels=int(size) ** 2)
    trainer = RollplexGRPOTrainer(model=model_path, reward_funcs=[accuracy_reward, format_reward], args=config,
                                  train_dataset=load_video_r1(data))
    clock = wall_step_clock()
    trainer.add_callback(clock)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "step_time" in r]
    result = {"step_s": clock.steps, "step_time_metric_s": [r["step_time"] for r in logs],
              "decode_s": [r["rollplex/decode_s"] for r in logs if "rollplex/decode_s" in r],
              "sync_s": [r["rollplex/weight_sync_s"] for r in logs if "rollplex/weight_sync_s" in r],
              "sync_bytes_copied": [r["rollplex/sync_bytes_copied"] for r in logs if "rollplex/sync_bytes_copied" in r],
              "sync_bytes_aliased": [r["rollplex/sync_bytes_aliased"] for r in logs
                                     if "rollplex/sync_bytes_aliased" in r]}
    if int(os.environ.get("RANK", 0)) == 0:
        Path(out, "result.json").write_text(json.dumps(result))
    # every rank done and the process groups released before the interpreter's exit, where gloo's threads could
    # otherwise abort a rank ("terminate called without an active exception"; RollplexGRPOTrainer.end)
    trainer.end()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(model_path: Path, data: Path, tmp: Path, name: str, backend: str, tp: int, share: str, mapping: str,
         views: str, prefill: str, args) -> dict:
    out = tmp / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "").replace("=", "")
    if name.endswith("vision replicated"):
        prefill += "+replicated"
    common = [str(model_path), str(data), str(out), backend, str(tp), share, mapping, views, prefill, str(args.steps),
              str(args.G), str(args.C), "bf16" if args.bf16 else "fp32", str(args.frames), str(args.size)]
    threads = max(1, (os.cpu_count() or 2) // tp)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    if tp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp}", f"--master-port={_port()}",
               __file__, "--worker", *common]
    else:
        cmd = [sys.executable, __file__, "--worker", *common]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-4000:]}")
    return json.loads((out / "result.json").read_text())


def _plan_bytes(model_path: Path, tp: int, views: bool) -> dict:
    """What the mapping's plan copies per sync on rank 0, and the rest of the rollout model's bytes (fp32);
    ``views``: with the plan's `view` class (split-K row-parallel weights)."""
    import torch
    from transformers import AutoConfig

    from rollplex_trl.backends.megatron.mapped_weights import mapping_options
    from rollplex_trl.backends.megatron.weights import sharding_options
    from rollplex_trl.sharding import model_spec_from_config, plan_sharding
    from rollplex_trl.sharding.shm import PAGE

    page = PAGE
    if torch.cuda.is_available():  # the CUDA VMM path maps granules, not 4 KiB pages
        from rollplex_trl.memory.cuda_vmm import granularity

        page = granularity(0, recommended=True)
    spec = model_spec_from_config(AutoConfig.from_pretrained(model_path))
    device = plan_sharding(spec, mapping_options(sharding_options(tp), 4, page, views=views)).devices[0]
    copied = sum(t.copied_bytes for t in device.tensors)
    total = 4 * sum(g.numel for g in spec.groups)
    return {"aliased": total - copied, "copied": copied}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--G", type=int, default=4)
    parser.add_argument("--C", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="whole runs per configuration (medians over all)")
    parser.add_argument("--quick", action="store_true", help="4 steps, 1 repeat")
    parser.add_argument("--max-tp", type=int, default=2, help="skip Megatron runs with a larger t (one GPU: 1)")
    parser.add_argument("--weight-mapping", default="auto", choices=["auto", "on"],
                        help="rollplex_weight_mapping of the mapped Megatron runs (on a GPU 'auto' does not map: "
                             "'on' takes the never-run CUDA VMM path)")
    parser.add_argument("--bf16", action="store_true",
                        help="TRL's default bf16 autocast for every run (default: fp32; gradient checkpointing is on "
                             "in both)")
    parser.add_argument("--frames", type=int, default=4, help="frames per synthetic video clip")
    parser.add_argument("--size", type=int, default=56, help="clip height and width in pixels (the pixel budget)")
    parser.add_argument("--runs", nargs="*", help="only these runs, by name (default: all)")
    parser.add_argument("--out", default="benchmarks/results/megatron.json")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 4, 1

    from rollplex_trl.data import SyntheticVideoConfig, write_synthetic_video_dataset
    from rollplex_trl.testing.checkpoints import get_checkpoint

    model_path = get_checkpoint("qwen2_5_vl", args.preset)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = write_synthetic_video_dataset(tmp / "data", SyntheticVideoConfig(
            num_samples=16, seed=0, num_frames=args.frames, height=args.size, width=args.size, fps=2))
        runs = [r for r in RUNS if r[2] <= args.max_tp and (not args.runs or r[0] in args.runs)]
        results: dict[str, list[dict]] = {r[0]: [] for r in runs}
        for repeat in range(args.repeats):  # alternating: a load spike hits one repeat of each, not one config
            for name, backend, tp, share, mapping, views, prefill in runs:
                mapping = args.weight_mapping if backend == "megatron" and mapping != "off" else mapping
                results[name].append(_run(model_path, data, tmp / f"r{repeat}", name, backend, tp, share, mapping,
                                          views, prefill, args))
        for name, backend, tp, share, mapping, views, prefill in runs:
            mapping = args.weight_mapping if backend == "megatron" and mapping != "off" else mapping
            steps, metric, copied, aliased, decode, sync = [], [], [], [], [], []
            for result in results[name]:
                steps += result["step_s"][1:]  # the first step warms up
                metric += result["step_time_metric_s"][1:]
                decode += result["decode_s"][1:]
                sync += result["sync_s"][1:]
                copied += result["sync_bytes_copied"]
                aliased += result["sync_bytes_aliased"]
            row = {"run": name, "backend": backend, "t": tp, "share_prefix": share, "weight_mapping": mapping,
                   "row_parallel_views": views, "rollout_prefill": prefill if backend == "megatron" else None,
                   "step_s": statistics.median(steps), "step_s_all": steps,
                   "step_time_metric_s": statistics.median(metric),
                   "decode_s": statistics.median(decode) if decode else None,
                   "weight_sync_s": statistics.median(sync) if sync else None}
            if backend == "megatron":
                row |= {"sync_bytes_copied": statistics.median(copied) if copied else None,
                        "sync_bytes_aliased": statistics.median(aliased) if aliased else None}
            if backend == "megatron" and mapping != "off":
                row["plan"] = _plan_bytes(model_path, tp, views != "off")
            rows.append(row)
    base = next((r["step_s"] for r in rows if r["backend"] == "hf" and r["share_prefix"] == "off"), None)
    default = next((r for r in rows if r["backend"] == "hf" and r["share_prefix"] != "off"), None)
    for row in rows:
        row["vs_hf_prefix_off"] = row["step_s"] / base if base else None
        row["vs_hf"] = row["step_s"] / default["step_s"] if default else None
        if default is not None:
            # paired: each repeat's median step over the `hf` run's of the same repeat (the two ran minutes apart,
            # so a slow hour of the shared machine moves both): the spread says how far one ratio can be trusted
            paired = [statistics.median(mine["step_s"][1:]) / statistics.median(hf["step_s"][1:])
                      for mine, hf in zip(results[row["run"]], results[default["run"]])]
            row["vs_hf_per_repeat"] = paired
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from bench_common import run_meta  # the script's folder is on sys.path (run as a script)

    meta = {**run_meta(), "preset": args.preset, "steps": args.steps, "repeats": args.repeats, "G": args.G,
            "C": args.C, "frames": args.frames, "size": args.size,
            "cpus": os.cpu_count(), "precision": "bf16 autocast" if args.bf16 else "fp32"}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"{'run':<26} {'step s':>8} {'metric s':>9} {'decode s':>9} {'sync s':>7} {'x hf off':>9} {'x hf':>6} "
          f"{'x hf per repeat (median, min-max)':>34} "
          f"{'copied MiB/sync':>16} "
          f"{'aliased MiB':>12} "
          f"{'plan copied':>12} {'plan aliased':>13}")
    for row in rows:
        plan = row.get("plan") or {}

        def mib(x):
            return "-" if x is None else f"{x / 2**20:.2f}"

        def sec(x):
            return "-" if x is None else f"{x:.3f}"

        def ratio(x):
            return "-" if x is None else f"{x:.2f}"

        def paired_text(row):
            paired = row.get("vs_hf_per_repeat")
            if not paired:
                return "-"
            return f"{statistics.median(paired):.2f} ({min(paired):.2f}-{max(paired):.2f})"

        print(f"{row['run']:<26} {row['step_s']:>8.3f} {row['step_time_metric_s']:>9.3f} {sec(row['decode_s']):>9} "
              f"{sec(row['weight_sync_s']):>7} "
              f"{ratio(row['vs_hf_prefix_off']):>9} {ratio(row['vs_hf']):>6} {paired_text(row):>34} "
              f"{mib(row.get('sync_bytes_copied')):>16} {mib(row.get('sync_bytes_aliased')):>12} "
              f"{mib(plan.get('copied')):>12} {mib(plan.get('aliased')):>13}")
    print(f"written: {out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()

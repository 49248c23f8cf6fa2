"""Benchmark: shared-prefix log-probs vs TRL's serial full forward, side by side in one run.

For each (G, prompt share) it builds three RollplexGRPOTrainer instances on the `small` local Qwen2.5-VL (or
`--family qwen3-vl`: a Qwen3-VL of the same sizes) and the synthetic video task, identical except for
`rollplex_share_prefix` ("off" = TRL's serial path, "on" = shared) and `rollplex_suffix_attention` ("concat": the
prompt's K/V copied to every row, what CUDA runs; "cascade": what CPU runs), and measures, on the same generation batch:
- the reference pass (no grad, reference model),
- the actor pass (forward + backward of the log-probs),
- the whole training step (transformers rollout + scoring + loss + optimizer) on the wall clock
  (`bench_common.wall_step_clock`; TRL's `step_time` metric beside it in the JSON).
It reports medians of several repeats and the serial/shared ratios, and a memory figure: on CUDA the peak
allocated bytes of each pass; on CPU (no allocator statistics) the bytes the actor pass saves for backward
(autograd saved tensors, deduplicated by storage), which is what dominates activation memory.

"auto" (`rollplex_share_prefix="auto"`, the default) is a fourth and fifth trainer per row (cascade and concat suffix):
each takes its decision through the trainer's own first rollout (prefix/cost.py: from the prompts, max_completion_length
= C and G; no timing), and then runs exactly the code of the path it chose, so its time is that path's time measured
above (reported as such, not measured a second time).

The prompt share P / (P + C) is set through the completion length C (generation is forced to exactly C tokens
with min_new_tokens); P is fixed by the clip (frames x size) and the prompt text.

Usage:  .venv/bin/python benchmarks/bench_shared_prefix.py [--quick] [--out benchmarks/results/shared_prefix.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_common import add_family_arg, quiet_checkpoint, run_meta, wall_step_clock


def _saved_bytes(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        try:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except Exception:  # noqa: BLE001 - some saved objects are not plain tensors
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _write(path: str, args, rows: list[dict]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**run_meta(), "preset": args.preset, "family": args.family, "frames": args.frames, "size": args.size,
            "prompts_per_step": args.prompts, "steps": args.steps, "repeats": args.repeats,
            "device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(),
            "torch": torch.__version__}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _dataset(tmp: Path, num_prompts: int, frames: int, size: int):
    from rollplex_trl.data import SyntheticVideoConfig, load_video_r1, write_synthetic_video_dataset

    annotations = write_synthetic_video_dataset(
        tmp / "data", SyntheticVideoConfig(num_samples=num_prompts, seed=0, num_frames=frames, height=size, width=size,
                                           fps=2))
    return load_video_r1(annotations)


def _trainer(model_path, dataset, tmp: Path, share: str, G: int, C: int, args, suffix_attention: str = "auto"):
    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.data import accuracy_reward, format_reward

    config = RollplexGRPOConfig(
        output_dir=str(tmp / f"out-{share}"), max_steps=args.steps, per_device_train_batch_size=G * args.prompts,
        num_generations=G, max_completion_length=C, generation_kwargs={"min_new_tokens": C}, beta=0.04,
        learning_rate=1e-6, logging_steps=1, report_to=[], save_strategy="no", seed=0, use_cpu=not
        torch.cuda.is_available(), bf16=False, gradient_checkpointing=True, rollplex_share_prefix=share,
        rollplex_video_max_frames=args.frames, rollplex_video_min_pixels=28 * 28 * 4,
        rollplex_video_max_pixels=args.size * args.size, rollplex_prefix_chunk_prompts=args.prompts,
        rollplex_suffix_attention=suffix_attention,
    )
    return RollplexGRPOTrainer(model=str(model_path), reward_funcs=[accuracy_reward, format_reward], args=config,
                               train_dataset=dataset)


def _measure(trainer, args, C: int) -> dict:
    """Whole-step time from training (skipped for completions longer than --max-step-completion: decoding them
    on a CPU takes too long), then the reference and actor passes on one batch whose completions are random
    tokens of length exactly C (the passes' cost does not depend on which tokens they score)."""
    steps, trl_steps = [], []
    if C <= args.max_step_completion:
        clock = wall_step_clock()
        trainer.add_callback(clock)
        trainer.train()
        steps = clock.steps[1:]  # the wall-clock step (bench_common.wall_step_clock), the warm-up step dropped
        trl_steps = [r["step_time"] for r in trainer.state.log_history if "step_time" in r][1:]
    trainer.model.train()
    G = trainer.num_generations
    short = trainer.max_completion_length
    trainer.max_completion_length = min(C, 4)  # a quick rollout just to get TRL's batch layout
    trainer.generation_config.max_new_tokens = trainer.max_completion_length
    trainer.generation_config.min_new_tokens = None
    batch = trainer._generate_and_score_completions([trainer.train_dataset[i // G] for i in range(G * args.prompts)])
    trainer.max_completion_length = short
    gen = torch.Generator().manual_seed(0)
    batch["completion_ids"] = torch.randint(100, 500, (batch["prompt_ids"].size(0), C), generator=gen)
    batch["completion_mask"] = torch.ones_like(batch["completion_ids"])
    rows = batch["rollplex_prompt"]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    C = batch["completion_ids"].size(1)
    cuda = torch.cuda.is_available()

    def ref_pass():
        with torch.no_grad(), trainer.batch.scoring(rows):
            trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, C,
                                                       batch_size=trainer.args.per_device_train_batch_size)

    def actor_pass():
        with trainer.batch.scoring(rows):
            logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C,
                                                                     compute_entropy=True)
        (logps * batch["completion_mask"]).sum().backward()
        trainer.model.zero_grad(set_to_none=True)

    result = {
        "P": int(batch["prompt_mask"].sum(1).float().mean()), "C": C,
        "prompt_share": float(batch["prompt_mask"].sum()
                              / (batch["prompt_mask"].sum() + batch["completion_mask"].sum())),
        "step_s": statistics.median(steps) if steps else None,
        "trl_step_time_s": statistics.median(trl_steps) if trl_steps else None,
        "ref_s": _median_time(ref_pass, args.repeats),
        "actor_s": _median_time(actor_pass, args.repeats),
    }
    if cuda:
        for name, fn in (("ref", ref_pass), ("actor", actor_pass)):
            torch.cuda.reset_peak_memory_stats()
            fn()
            result[f"{name}_peak_bytes"] = torch.cuda.max_memory_allocated()
    result["actor_saved_bytes"] = _saved_bytes(actor_pass)
    return result


def _auto_decision(trainer, args) -> dict:
    """The trainer's own `auto` decision, taken at its first rollout (a short one: the decision reads the prompts,
    and max_completion_length from the configuration, not the completions)."""
    G = trainer.num_generations
    trainer.max_completion_length = 2
    trainer.generation_config.max_new_tokens, trainer.generation_config.min_new_tokens = 2, None
    trainer.model.train()
    trainer._generate_and_score_completions([trainer.train_dataset[i // G] for i in range(G * args.prompts)])
    choice = trainer.sharing.decision.choice
    return {"share": choice.share, "modelled_speedup": choice.modelled_speedup}


def _auto_text(auto: dict) -> str:
    verdict = "on" if auto["share"] else "off"
    return f"{verdict} {auto['ratio_ref_plus_actor']:.2f}x (model {auto['modelled_speedup']:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    add_family_arg(parser)
    parser.add_argument("--generations", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--completion-lengths", type=int, nargs="+", default=None,
                        help="C values (default: chosen for ~50/80/95%% prompt share)")
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--prompts", type=int, default=1, help="prompts per step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="G=8 and ~90%% share only")
    parser.add_argument("--low-share", action="store_true",
                        help="also ~30%% and ~10%% prompt share at G = 8 and 16 (long completions: passes only)")
    parser.add_argument("--low-share-generations", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--max-step-completion", type=int, default=320,
                        help="measure the whole step only up to this completion length")
    parser.add_argument("--out", default="benchmarks/results/shared_prefix.json")
    args = parser.parse_args()
    model_path = quiet_checkpoint(args.preset, args.family)
    tmp = Path(tempfile.mkdtemp(prefix="rollplex-bench-"))
    dataset = _dataset(tmp, num_prompts=max(8, args.prompts * args.steps), frames=args.frames, size=args.size)
    probe = _trainer(model_path, dataset, tmp, "off", 2, 8, args)
    P = probe.train_dataset[0]["rollplex_prompt"].num_prompt_tokens
    del probe
    if args.quick:
        args.generations, lengths = [8], [max(2, round(P / 9))]
    else:
        lengths = args.completion_lengths or [max(2, round(P * (1 - s) / s)) for s in (0.95, 0.8, 0.5)]
    grid = [(G, C) for G in args.generations for C in lengths]
    if args.low_share:
        grid += [(G, round(P * (1 - s) / s)) for G in args.low_share_generations for s in (0.3, 0.1)]
    rows = []
    # serial (TRL's full forward), shared with the prompt's K/V copied per row (concat), shared with cascade
    # suffix attention (what rollplex_suffix_attention="auto" runs on CPU)
    variants = {"serial": ("off", "concat"), "shared_concat": ("on", "concat"), "shared": ("on", "cascade")}
    for G, C in grid:
        measured = {}
        for name, (share, attention) in variants.items():
            torch.manual_seed(0)
            measured[name] = _measure(_trainer(model_path, dataset, tmp, share, G, C, args, attention), args, C)
        serial, shared, concat = measured["serial"], measured["shared"], measured["shared_concat"]
        auto = {attention: _auto_decision(_trainer(model_path, dataset, tmp, "auto", G, C, args, attention), args)
                for attention in ("cascade", "concat")}
        serial_s = serial["ref_s"] + serial["actor_s"]
        for attention, path in (("cascade", shared), ("concat", concat)):
            chosen = path if auto[attention]["share"] else serial
            auto[attention]["ratio_ref_plus_actor"] = serial_s / (chosen["ref_s"] + chosen["actor_s"])
        row = {"G": G, "C": C, "P": serial["P"], "prompt_share": serial["prompt_share"],
               "serial": serial, "shared": shared, "shared_concat": concat, "auto": auto,
               "ratio_ref_plus_actor_concat": (serial["ref_s"] + serial["actor_s"])
               / (concat["ref_s"] + concat["actor_s"]),
               "actor_saved_bytes_ratio_concat": concat["actor_saved_bytes"] / serial["actor_saved_bytes"],
               "ratio_ref": serial["ref_s"] / shared["ref_s"],
               "ratio_actor": serial["actor_s"] / shared["actor_s"],
               "ratio_ref_plus_actor": (serial["ref_s"] + serial["actor_s"])
               / (shared["ref_s"] + shared["actor_s"]),
               "ratio_step": serial["step_s"] / shared["step_s"] if serial["step_s"] else None,
               "actor_saved_bytes_ratio": shared["actor_saved_bytes"] / serial["actor_saved_bytes"]}
        rows.append(row)
        _write(args.out, args, rows)
        print(f"G={G:>2} P={row['P']:>4} C={C:>4} share={row['prompt_share']:.0%}  "
              f"ref {serial['ref_s']:.3f}/{shared['ref_s']:.3f}s ({row['ratio_ref']:.2f}x)  "
              f"actor {serial['actor_s']:.3f}/{shared['actor_s']:.3f}s ({row['ratio_actor']:.2f}x)  "
              f"step {_fmt(serial['step_s'])}/{_fmt(shared['step_s'])}s ({_fmt(row['ratio_step'])}x)  "
              f"actor saved bytes x{row['actor_saved_bytes_ratio']:.2f}  "
              f"(concat: ref+actor {row['ratio_ref_plus_actor_concat']:.2f}x, "
              f"saved x{row['actor_saved_bytes_ratio_concat']:.2f})  auto: cascade "
              f"{_auto_text(auto['cascade'])}, concat {_auto_text(auto['concat'])}", flush=True)

    out = _write(args.out, args, rows)
    print()
    print("| G | P | C | prompt share | ref serial / concat / cascade (s) | actor serial / concat / cascade (s) | "
          "ref+actor vs serial: concat | cascade | auto (cascade) | auto (concat) | step serial (s) | "
          "step cascade (s) | ratio | actor saved bytes concat/serial | cascade/serial |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s, h, c = r["serial"], r["shared"], r["shared_concat"]
        print(f"| {r['G']} | {r['P']} | {r['C']} | {r['prompt_share']:.0%} | "
              f"{s['ref_s']:.3f} / {c['ref_s']:.3f} / {h['ref_s']:.3f} | "
              f"{s['actor_s']:.3f} / {c['actor_s']:.3f} / {h['actor_s']:.3f} | "
              f"{r['ratio_ref_plus_actor_concat']:.2f}x | {r['ratio_ref_plus_actor']:.2f}x | "
              f"{_auto_text(r['auto']['cascade'])} | {_auto_text(r['auto']['concat'])} | {_fmt(s['step_s'])} | "
              f"{_fmt(h['step_s'])} | {_fmt(r['ratio_step'])}x | {r['actor_saved_bytes_ratio_concat']:.2f} | "
              f"{r['actor_saved_bytes_ratio']:.2f} |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
